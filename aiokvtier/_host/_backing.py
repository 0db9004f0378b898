"""How the tier's range is reserved, committed and released.

A backing owns the address range. The tier calls ``Backing.commit()`` and
``Backing.decommit()`` with whole commit units only (so a GPU backing can
register each unit separately), from its fill threads or off the event loop.
Each backing undoes its own partial work when a commit fails. A decommit that
fails may have done part of its work (``madvise`` discards the pages before
the first locked one, then fails): the unit is *stranded*, still the
backing's, and ``Backing.recommit()`` makes it whole again before the tier
uses it.

::

    Backing (interface)
    ├── HostBacking        mmap + mbind + touch pages: the host-only tier
    │   └── RegisterBacking    + cuMemHostRegister per unit   (aiokvtier._cuda)
    └── VmmBacking         cuMemAddressReserve + cuMemCreate per unit (aiokvtier._cuda)
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from abc import ABC, abstractmethod
from contextlib import ExitStack
from typing import TYPE_CHECKING, Literal, Protocol, Self

from .._errors import NumaPolicyError
from . import _linux, _userfault
from ._hugepages import HugePagePolicy

if TYPE_CHECKING:
    from .._config import ResolvedHostConfig

__all__ = ["Backing", "Backings", "HostBacking"]

log = logging.getLogger("aiokvtier")

HUGE_ALIGN = 2 << 20


class Backing(ABC):
    """An address range reserved at construction, committed unit by unit."""

    name: str
    base: int
    size: int
    numa_policy: str = "none"
    """``"preferred"``, ``"bind"``, ``"first-touch"`` (mbind denied) or ``"none"``."""
    numa_warning: str | None = None
    registered_bytes: int = 0
    fill_method: str = "touch"
    """How units are made resident: ``"copy"`` (``UFFDIO_COPY``), ``"touch"`` (page faults, or
    ``MADV_POPULATE_WRITE`` when memory is short) or ``"driver"`` (the vmm backing's ``cuMemCreate``)."""

    @property
    def huge_page_units(self) -> int:
        """Committed units given huge pages by ``transparent_huge_pages="auto"``."""
        return 0

    @property
    def huge_pages_given_up(self) -> bool:
        return False

    def expose(self, end: int) -> None:  # noqa: B027 - an optional hook, empty by default
        """Make ``[0, end)`` accessible ahead of its commits, and the range past it inaccessible.

        Called once per resize, never on the fill's hot path: before the fill
        grows to ``end``, and after a shrink's tail is decommitted.
        """

    def thread_setup(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Prepare a library-started thread before it calls ``commit()`` (CUDA context)."""

    @abstractmethod
    def commit(self, offset: int, length: int) -> None:
        """Make ``[offset, offset+length)`` resident (and GPU-usable). Undoes itself on failure."""

    @abstractmethod
    def decommit(self, offset: int, length: int) -> None:
        """Return a committed unit's memory; its contents are lost.

        :raises OSError: or ``CudaError``: the unit is stranded (it may be
            partly decommitted): the caller keeps it, and calls ``recommit()``
            before using it again, or ``decommit`` again, or lists it at release.
        """

    def recommit(self, offset: int, length: int) -> None:  # noqa: B027 - nothing to redo by default
        """Make a stranded unit (one whose ``decommit()`` failed) committed again, as ``commit()`` would.

        Called from a fill thread. The contents it kept are not defined. The
        default does nothing: a backing whose failed decommit changes nothing.

        :raises OSError: or ``CudaError``: the unit stays stranded.
        """

    @abstractmethod
    def release(self, committed: list[tuple[int, int]]) -> None:
        """Give the whole range back, with the units still ``committed``. Called once."""


def apply_numa_policy(base: int, size: int, node: int | None, strict: bool) -> tuple[str, str | None]:
    """mbind ``[base, base+size)`` to ``node`` before any page is touched.

    :returns: ``(policy, warning)``.
    :raises NumaPolicyError: mbind failed and ``strict`` forbids falling back.
    """
    if node is None:
        return "none", None
    mode = _linux.MPOL_BIND if strict else _linux.MPOL_PREFERRED
    try:
        _linux.mbind(base, size, mode, node)
    except OSError as exc:
        if strict:
            raise NumaPolicyError(
                f"cannot bind the tier to NUMA node {node}: {exc.strerror} "
                "(containers need CAP_SYS_NICE for mbind; set allow_remote_numa_fallback=True "
                "to fall back to first touch by the bound fill thread)"
            ) from exc
        hint = " (containers need CAP_SYS_NICE)" if exc.errno == errno.EPERM else ""
        warning = (
            f"mbind to NUMA node {node} denied: {exc.strerror}{hint}; "
            "relying on first touch by the fill thread bound to the node"
        )
        log.warning(warning)
        return "first-touch", warning
    return ("bind" if strict else "preferred"), None


class Backings(Protocol):
    """What a tier is handed to build its backing (both calls blocking: the tier runs them off the loop)."""

    def numa_node(self, config: ResolvedHostConfig) -> int | None:
        """The node the tier's pages go to (``config.numa_node``, or the device's node for ``"auto"``)."""
        ...

    def make(self, config: ResolvedHostConfig, node: int | None) -> Backing:
        """Reserve ``config.max_quota`` for ``config.backing`` with pages bound to ``node``."""
        ...


def host_backing(config: ResolvedHostConfig, node: int | None) -> HostBacking:
    """The host-only backing ``config`` asks for."""
    return HostBacking.from_config(config, node)


class HostBacking(Backing):
    """Anonymous memory: a PROT_NONE reservation, read-write up to the fill target, pages touched per unit.

    The reservation is not charged against the commit limit, so reserving far
    more than free RAM succeeds; THP advice and the NUMA policy are attached to
    the whole range before any page is touched.

    The range up to the fill target is made read-write with one ``mprotect``
    per resize, not one per unit: ``mprotect`` needs the address space's lock
    exclusively, and one per unit made fill threads wait for each other and
    stalled every other thread's mmap (docs/guide.md, "How the fill works").
    Past the target the range stays PROT_NONE. Below it, a unit not yet
    committed is memory that the tier never hands out (slots are taken only
    below the watermark, and raw copies past it are refused); where the fill
    copies its units in (``_userfault``, the default on Linux 6.9+ with
    4 KiB pages), touching such a page raises SIGBUS, elsewhere it reads zeros.
    Where the kernel charges a writable private mapping in full (strict
    overcommit, ``vm.overcommit_memory=2``), the one large ``mprotect`` fails
    with ENOMEM; the backing then opens each unit as it commits it, as
    before, so running out of memory stays a partial failure.
    """

    name = "host"

    @classmethod
    def from_config(cls, config: ResolvedHostConfig, node: int | None) -> Self:
        """Reserve ``config.max_quota`` with the config's NUMA strictness and huge-page setting.

        A subclass (one that wraps a call, say) is built the same way, so a ``Backings`` can hand a
        tier one in place of the default.

        :raises OSError: the range cannot be reserved or advised.
        :raises NumaPolicyError: strict placement on ``node`` was refused.
        """
        return cls(
            config.max_quota,
            node=node,
            strict_numa=not config.allow_remote_numa_fallback,
            huge_pages=config.transparent_huge_pages,
        )

    def __init__(self, size: int, *, node: int | None, strict_numa: bool, huge_pages: bool | Literal["auto"]) -> None:
        self.base, self.size = _linux.mmap_reserve(size, HUGE_ALIGN)
        self._exposed = 0
        self._per_unit = False
        # "auto": 4 KiB pages for the range, and huge pages advised unit by unit where they cannot lose.
        self._thp = HugePagePolicy(node) if huge_pages == "auto" else None
        self._thp_lock = threading.Lock()
        self._advised_huge: set[int] = set()
        self._huge_units: set[int] = set()
        with ExitStack() as undo:
            undo.callback(_linux.munmap, self.base, self.size)
            advice = _linux.MADV_HUGEPAGE if huge_pages is True else _linux.MADV_NOHUGEPAGE
            try:
                _linux.madvise(self.base, self.size, advice)
            except OSError as exc:
                # Kernels built without THP refuse the advice; nothing to turn off then.
                if huge_pages is True or exc.errno != errno.EINVAL:
                    raise
            self.numa_policy, self.numa_warning = apply_numa_policy(self.base, self.size, node, strict_numa)
            self._userfault = self._register(huge_pages)
            undo.pop_all()

    def _register(self, huge_pages: bool | Literal["auto"]) -> _userfault.Userfault | None:
        """The whole reservation registered for ``UFFDIO_COPY`` fills where the kernel allows it
        (4 KiB pages only: the kernel copies into small pages); else None, and units are touched."""
        if huge_pages is not False or not _userfault.supported():
            return None
        try:
            uf = _userfault.Userfault(self.base, self.size)
        except OSError as exc:
            log.warning("aiokvtier: the fill touches its pages (userfaultfd refused: %s)", exc)
            return None
        try:
            _userfault.activate(uf)
        except BaseException:
            uf.close()
            raise
        self.fill_method = "copy"
        return uf

    def expose(self, end: int) -> None:
        end = min(end, self.size)
        if self._per_unit or end == self._exposed:
            return
        if end > self._exposed:
            try:
                _linux.mprotect(self.base + self._exposed, end - self._exposed, writable=True)
            except OSError as exc:
                if exc.errno != errno.ENOMEM:
                    raise
                log.warning("aiokvtier: the kernel charges writable mappings in full; opening the range unit by unit")
                self._per_unit = True
                return
        else:
            _linux.mprotect(self.base + end, self._exposed - end, writable=False)
        self._exposed = end

    def commit(self, offset: int, length: int) -> None:
        addr = self.base + offset
        if self._per_unit or offset + length > self._exposed:
            _linux.mprotect(addr, length, writable=True)
        try:
            if self._thp is None:
                _linux.populate(addr, length)
            else:
                self._commit_auto(offset, length)
        except BaseException:
            self._discard(offset, length)
            raise

    def _commit_auto(self, offset: int, length: int) -> None:
        assert self._thp is not None
        addr = self.base + offset
        huge = self._thp.choose(length)
        with self._thp_lock:
            advised = offset in self._advised_huge
        if huge != advised:
            # Splits the mapping (the address space's lock, exclusively, for microseconds: no
            # fill thread holds it for longer now); adjacent units with the same advice merge.
            _linux.madvise(addr, length, _linux.MADV_HUGEPAGE if huge else _linux.MADV_NOHUGEPAGE)
            with self._thp_lock:
                (self._advised_huge.add if huge else self._advised_huge.discard)(offset)
        started = time.perf_counter()
        _linux.populate(addr, length)
        self._thp.record(huge, length, time.perf_counter() - started)
        if huge:
            with self._thp_lock:
                self._huge_units.add(offset)

    @property
    def huge_page_units(self) -> int:
        """Committed units advised huge pages by ``transparent_huge_pages="auto"``."""
        with self._thp_lock:
            return len(self._huge_units)

    @property
    def huge_pages_given_up(self) -> bool:
        return self._thp is not None and self._thp.given_up

    def decommit(self, offset: int, length: int) -> None:
        self._discard(offset, length)

    def recommit(self, offset: int, length: int) -> None:
        """Make resident again the pages of a stranded unit that its failed decommit discarded.

        ``MADV_DONTNEED`` walks the unit mapping by mapping and stops with
        EINVAL at the first locked one, so the pages before it are gone: with
        copies they would raise SIGBUS when touched. Only the pages that
        ``mincore`` reports absent are made resident (present ones, locked or
        not, keep what they hold).
        """
        addr = self.base + offset
        opened = self._per_unit or offset + length > self._exposed
        if opened:
            _linux.mprotect(addr, length, writable=True)
        try:
            for start, n in _linux.absent_runs(addr, length):
                _linux.populate(start, n)
        except BaseException:
            if opened:
                try:
                    _linux.mprotect(addr, length, writable=False)
                except OSError as exc:
                    log.error("aiokvtier: closing the stranded unit at +%d again failed: %s", offset, exc)
            raise

    def _discard(self, offset: int, length: int) -> None:
        addr = self.base + offset
        try:
            _linux.madvise(addr, length, _linux.MADV_DONTNEED)
        finally:
            # Closed even where the advice failed: past the target the range stays PROT_NONE.
            if self._per_unit or offset + length > self._exposed:
                _linux.mprotect(addr, length, writable=False)
        with self._thp_lock:
            self._huge_units.discard(offset)

    def release(self, committed: list[tuple[int, int]]) -> None:
        uf, self._userfault = self._userfault, None
        if uf is not None:
            _userfault.deactivate(uf)
        try:
            _linux.munmap(self.base, self.size)
        finally:
            if uf is not None:
                uf.close()
