"""``aiokvtier doctor``: what this host offers a tier, one check at a time, with advice.

Every check is synchronous and cheap: small reads from procfs and sysfs, and
two syscalls tried on a scratch mapping of a few MiB (made resident, then
unmapped) because only trying says whether seccomp or the kernel allows them.
A check's verdict is one of:

- ``ok``: nothing to do;
- ``info``: worth knowing, nothing wrong;
- ``warn``: works, but slower or degraded; the advice says what to change;
- ``fail``: a tier cannot work here (the only verdict that makes the command exit non-zero);
- ``skip``: not applicable (no NUMA sysfs, no CUDA device).
"""

from __future__ import annotations

import errno
import importlib.metadata
import os
import platform
import re
import resource
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import _sysinfo
from ._units import format_bytes

__all__ = ["Check", "Verdict", "report", "run_checks", "format_line"]

Verdict = Literal["ok", "info", "warn", "fail", "skip"]

_THP = Path("/sys/kernel/mm/transparent_hugepage")
_NODES = Path("/sys/devices/system/node")
_SCRATCH = 4 << 20  # two 2 MiB halves: one for mbind (untouched), one to populate


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the doctor's report."""

    name: str
    verdict: Verdict
    summary: str
    """What was found, in one line."""
    advice: str = ""
    """What to do about it; empty when there is nothing to do."""
    data: dict[str, Any] = field(default_factory=dict)
    """The figures behind the summary, for ``--json``."""

    @property
    def fatal(self) -> bool:
        return self.verdict == "fail"


def format_line(check: Check) -> str:
    """``WARN  thp         enabled=always defrag=always  -> ...`` (one line, no newline)."""
    line = f"{check.verdict.upper():<5} {check.name:<11} {check.summary}"
    return f"{line}  -> {check.advice}" if check.advice else line


def report(checks: list[Check]) -> dict[str, Any]:
    """The ``--json`` document: the version, whether any check is fatal, and every check."""
    from . import __version__

    return {
        "aiokvtier": __version__,
        "fatal": any(c.fatal for c in checks),
        "checks": [asdict(c) for c in checks],
    }


# -- memory and the max_quota default -------------------------------------------------------------


def check_memory(meminfo: Path = Path("/proc/meminfo")) -> Check:
    """MemTotal, MemAvailable, the memory cgroup's limit, and the ``max_quota`` default they give."""
    from ._config import default_max_quota

    info = _sysinfo.meminfo(meminfo)
    total = _sysinfo.host_memory_bytes()
    available, bound = _sysinfo.available_memory()
    cgroup = _sysinfo.cgroup_memory()
    default = default_max_quota()
    data = {
        "mem_total_bytes": info.get("MemTotal", total),
        "mem_available_bytes": info.get("MemAvailable"),
        "available_bytes": available,
        "available_bound": bound,
        "cgroup_version": cgroup.version,
        "cgroup_limit_bytes": cgroup.limit,
        "cgroup_usage_bytes": cgroup.usage,
        "default_max_quota_bytes": default,
    }
    if cgroup.limit is None:
        where = f"cgroup {cgroup.version}: no limit" if cgroup.version else "no memory cgroup"
    else:
        where = f"cgroup {cgroup.version} limit {format_bytes(cgroup.limit)}"
    origin = "the cgroup limit" if cgroup.limit is not None and cgroup.limit < total else "MemTotal"
    summary = (
        f"MemTotal {format_bytes(total)}, available {format_bytes(available)} ({bound}), {where}; "
        f"max_quota defaults to {format_bytes(default)} ({origin})"
    )
    if cgroup.limit is not None and cgroup.limit < total:
        return Check(
            "memory",
            "info",
            summary,
            "a quota past the cgroup limit gets the process OOM-killed: raise the container's memory limit "
            "to go higher",
            data,
        )
    return Check("memory", "ok", summary, "", data)


def check_virtualization(cpuinfo: Path = Path("/proc/cpuinfo")) -> Check:
    """A VM's MemTotal can start low and grow with use, which makes the ``max_quota`` default too small."""
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    vendor = _read(Path("/sys/class/dmi/id/sys_vendor"))
    if re.search(r"\bhypervisor\b", flags):
        return Check(
            "vm",
            "info",
            f"a virtual machine ({vendor or 'hypervisor flag set'})",
            "where MemTotal grows as memory is used (ballooning, hot-plug), pass max_quota explicitly",
            {"virtual": True, "vendor": vendor},
        )
    return Check("vm", "ok", "no hypervisor flag", "", {"virtual": False, "vendor": vendor})


# -- syscalls tried on a scratch mapping ----------------------------------------------------------


@contextmanager
def _scratch() -> Iterator[int]:
    from ._host import _linux

    base, length = _linux.mmap_reserve(_SCRATCH, 2 << 20)
    try:
        _linux.mprotect(base, length, writable=True)
        yield base
    finally:
        _linux.munmap(base, length)


def check_populate() -> Check:
    """Whether ``MADV_POPULATE_WRITE`` (Linux 5.14) works: the fill's way of faulting pages in."""
    from ._host import _linux

    try:
        with _scratch() as base:
            try:
                _linux.madvise(base + _SCRATCH // 2, _SCRATCH // 2, _linux.MADV_POPULATE_WRITE)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    return Check(
                        "populate",
                        "warn",
                        f"MADV_POPULATE_WRITE is not supported (kernel {platform.release()})",
                        "the fill falls back to writing every page from its thread; a kernel from 5.14 on "
                        "faults pages without touching them",
                        {"supported": False, "errno": exc.errno},
                    )
                raise
    except OSError as exc:
        return Check(
            "populate",
            "fail",
            f"a {format_bytes(_SCRATCH)} scratch mapping could not be made resident: {exc.strerror}",
            "no tier can work here: check vm.overcommit_memory, the cgroup limit and ulimit -v",
            {"supported": None, "errno": exc.errno},
        )
    return Check("populate", "ok", "MADV_POPULATE_WRITE works on a scratch mapping", "", {"supported": True})


def check_copy_fill() -> Check:
    """Whether the fill copies units in (``UFFDIO_COPY``): a scratch range registered and filled."""
    from ._host import _userfault

    version = ".".join(map(str, _userfault.MIN_KERNEL))
    if not _userfault.supported():
        return Check(
            "copy-fill",
            "info",
            f"the fill touches its pages: copying them in needs Linux {version}+ on x86-64 or arm64 "
            f"(kernel {platform.release()}, {platform.machine()})",
            f"on Linux {version}+ the fill copies 4 KiB pages 1.5-1.8x faster than it touches them",
            {"supported": False, "reason": "kernel"},
        )
    with _scratch() as base:
        try:
            uf = _userfault.Userfault(base, _SCRATCH)
        except OSError as exc:
            return Check(
                "copy-fill",
                "warn",
                f"the fill touches its pages: userfaultfd was refused ({exc.strerror or exc})",
                "a seccomp filter (Docker's default profile denies userfaultfd) or "
                "vm.unprivileged_userfaultfd; allowing it makes the fill 1.5-1.8x faster",
                {"supported": False, "reason": "refused", "errno": exc.errno},
            )
        try:
            uf.copy(base, _SCRATCH)
        finally:
            uf.close()
    return Check(
        "copy-fill",
        "ok",
        f"the fill copies units in (UFFDIO_COPY) on a scratch range of {format_bytes(_SCRATCH)}",
        "",
        {"supported": True},
    )


def _cap_sys_nice(status: Path = Path("/proc/self/status")) -> tuple[bool | None, int | None]:
    """(CAP_SYS_NICE in the effective set, seccomp mode), None where unreadable."""
    text = _read(status) or ""
    cap = re.search(r"^CapEff:\s*([0-9a-f]+)", text, re.M)
    mode = re.search(r"^Seccomp:\s*(\d+)", text, re.M)
    return (bool(int(cap.group(1), 16) >> 23 & 1) if cap else None, int(mode.group(1)) if mode else None)


def check_mbind() -> Check:
    """Whether ``mbind`` is permitted (Docker's default seccomp profile denies it without CAP_SYS_NICE)."""
    from ._host import _linux

    nodes = _sysinfo.online_nodes()
    if not nodes:
        return Check("mbind", "skip", "no NUMA sysfs: the tier places no pages", "", {"permitted": None})
    node = min(nodes)
    cap, seccomp = _cap_sys_nice()
    data: dict[str, Any] = {"node": node, "cap_sys_nice": cap, "seccomp": seccomp}
    try:
        with _scratch() as base:
            _linux.mbind(base, _SCRATCH // 2, _linux.MPOL_PREFERRED, node)
    except OSError as exc:
        data.update(permitted=False, errno=exc.errno)
        if exc.errno in (errno.EPERM, errno.EACCES):
            why = f"denied ({exc.strerror}; seccomp mode {seccomp}, CAP_SYS_NICE {'on' if cap else 'off'})"
            advice = (
                "in a container, add CAP_SYS_NICE (docker run --cap-add SYS_NICE); meanwhile the default "
                "allow_remote_numa_fallback=True places pages by first touch from a bound fill thread, and "
                "allow_remote_numa_fallback=False fails the open"
            )
        else:
            why, advice = f"failed: {exc.strerror}", "pages are placed by first touch from the bound fill thread"
        return Check("mbind", "warn", f"mbind(MPOL_PREFERRED, node {node}) {why}", advice, data)
    data["permitted"] = True
    return Check("mbind", "ok", f"mbind(MPOL_PREFERRED, node {node}) is permitted", "", data)


# -- transparent huge pages and NUMA nodes --------------------------------------------------------


def _selected(text: str | None) -> str | None:
    """``"always [madvise] never"`` -> ``"madvise"``."""
    if text is None:
        return None
    found = re.search(r"\[([^\]]+)\]", text)
    return found.group(1) if found else text.strip() or None


def check_thp(root: Path = _THP) -> Check:
    """THP ``enabled`` and ``defrag``: what ``transparent_huge_pages=True`` would get, and at what risk."""
    enabled, defrag = _selected(_read(root / "enabled")), _selected(_read(root / "defrag"))
    data = {"enabled": enabled, "defrag": defrag}
    if enabled is None:
        return Check("thp", "skip", "no transparent huge page support in this kernel", "", data)
    summary = f"enabled={enabled} defrag={defrag}"
    if enabled == "never":
        return Check(
            "thp",
            "info",
            summary,
            "transparent_huge_pages=True has no effect here (the fill runs on 4 KiB pages)",
            data,
        )
    if defrag == "always":
        return Check(
            "thp",
            "warn",
            summary,
            "every huge page fault may stall in direct compaction, the tier's opted-in range included; "
            "echo defer+madvise > /sys/kernel/mm/transparent_hugepage/defrag",
            data,
        )
    if defrag in ("madvise", "defer+madvise"):
        return Check(
            "thp",
            "ok",
            summary,
            "with transparent_huge_pages=True the fill compacts memory itself on a fragmented node "
            "(measured 10x slower): opt in where the nodes below have free 2 MiB blocks",
            data,
        )
    return Check("thp", "ok", summary, "", data)


def _huge_order(root: Path = _THP) -> int:
    """The buddy order of a PMD huge page (9 for 2 MiB on 4 KiB pages)."""
    size = _read(root / "hpage_pmd_size")
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        return max(0, (int(size) // page).bit_length() - 1) if size else 9
    except ValueError:
        return 9


def free_blocks(buddyinfo: str, order: int) -> dict[int, int]:
    """Free blocks of ``order`` pages or larger per node, counted in ``order``-sized blocks."""
    per_node: dict[int, int] = {}
    for line in buddyinfo.splitlines():
        found = re.match(r"Node\s+(\d+),\s*zone\s+\S+\s+(.*)", line)
        if not found:
            continue
        counts = [int(c) for c in found.group(2).split()]
        node = int(found.group(1))
        per_node[node] = per_node.get(node, 0) + sum(n << (k - order) for k, n in enumerate(counts) if k >= order)
    return per_node


def check_numa(nodes_root: Path = _NODES, buddyinfo: Path = Path("/proc/buddyinfo")) -> list[Check]:
    """One check per NUMA node: its CPUs, its memory, and its free huge-page-sized blocks."""
    try:
        online = _sysinfo.parse_cpulist((nodes_root / "online").read_text())
    except OSError:
        return [Check("numa", "skip", "no NUMA sysfs: numa_node='auto' binds nothing", "", {"nodes": None})]
    order = _huge_order()
    page = os.sysconf("SC_PAGE_SIZE")
    block = page << order
    blocks = free_blocks(_read(buddyinfo) or "", order)
    checks = []
    for node in sorted(online):
        here = nodes_root / f"node{node}"
        try:
            cpus = _sysinfo.parse_cpulist((here / "cpulist").read_text())
        except OSError:
            cpus = set()
        try:
            info = _sysinfo.meminfo(here / "meminfo")
        except OSError:
            info = {}
        total, free = info.get("MemTotal", 0), info.get("MemFree", 0)
        huge = blocks.get(node, 0) * block
        data = {
            "node": node,
            "cpus": sorted(cpus),
            "mem_total_bytes": total,
            "mem_free_bytes": free,
            "huge_block_bytes": block,
            "free_huge_blocks": blocks.get(node, 0),
        }
        summary = (
            f"{len(cpus)} CPUs ({_cpulist(cpus)}), {format_bytes(total)}, {format_bytes(free)} free, "
            f"{blocks.get(node, 0):,} free {format_bytes(block)} blocks ({format_bytes(huge)})"
        )
        name = f"numa{node}"
        if not cpus:
            checks.append(
                Check(name, "info", f"memory only: {summary}", "no fill thread can run here: bind pages by mbind", data)
            )
        elif free >= 1 << 30 and huge < free // 4:
            checks.append(
                Check(
                    name,
                    "warn",
                    summary,
                    "fragmented: less than a quarter of the free memory is in huge-page blocks, so "
                    "transparent_huge_pages=True would compact as it fills; leave it off here, or "
                    "echo 1 > /proc/sys/vm/compact_memory first",
                    data,
                )
            )
        else:
            checks.append(Check(name, "ok", summary, "", data))
    return checks


def _cpulist(cpus: set[int]) -> str:
    if not cpus:
        return "none"
    runs: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(runs)


# -- limits ---------------------------------------------------------------------------------------


def check_memlock() -> Check:
    """RLIMIT_MEMLOCK: the CUDA driver's pinning ignores it, but NIC registration of the tier does not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    data = {
        "soft": None if soft == resource.RLIM_INFINITY else soft,
        "hard": None if hard == resource.RLIM_INFINITY else hard,
    }
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", "ok", "RLIMIT_MEMLOCK unlimited", "", data)
    return Check(
        "memlock",
        "info",
        f"RLIMIT_MEMLOCK {format_bytes(soft)}",
        "enough for the CUDA backings; to register the tier with an RDMA NIC as well, raise it "
        "(ulimit -l unlimited, docker --ulimit memlock=-1)",
        data,
    )


# -- CUDA -----------------------------------------------------------------------------------------


def _nvidia_driver(path: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", _read(path) or "")
    return found.group(1) if found else None


def check_cuda() -> list[Check]:
    """The driver, and for each GPU its bus id, its NUMA node, and what ``backing="auto"`` picks."""
    try:
        bindings = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        bindings = None
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return [
            Check(
                "cuda",
                "skip",
                "no CUDA device checked: cuda-bindings is not installed",
                "for GPU-usable tiers: pip install 'aiokvtier[cuda]'",
                {"bindings": None},
            )
        ]
    from ._config import HostTierConfig
    from ._cuda import _driver
    from ._errors import AiokvtierError

    try:
        drv = _driver.driver()
        count = _driver.device_count()
    except AiokvtierError as exc:
        return [Check("cuda", "skip", f"no CUDA device: {exc}", "", {"bindings": bindings, "devices": 0})]
    version = int(_driver.check("cuDriverGetVersion", drv.cuDriverGetVersion()))
    kernel = _nvidia_driver()
    data = {"bindings": bindings, "driver_api": version, "kernel_module": kernel, "devices": count}
    api = f"{version // 1000}.{version % 1000 // 10}"
    summary = f"driver {kernel or '?'} (CUDA {api}), cuda-bindings {bindings}, {count} GPU(s)"
    checks = []
    if bindings is not None and _older(bindings, (12, 9, 1)):
        checks.append(
            Check(
                "cuda",
                "warn",
                summary,
                "cuda-bindings before 12.9.1 holds the GIL in driver calls, so registering stalls the event "
                "loop: pip install -U 'aiokvtier[cuda]'",
                data,
            )
        )
    elif count == 0:
        checks.append(Check("cuda", "skip", f"{summary}: no CUDA device", "", data))
    else:
        checks.append(Check("cuda", "ok", summary, "", data))
    nodes = _sysinfo.online_nodes()
    for device in range(count):
        dev = _driver.check("cuDeviceGet", drv.cuDeviceGet(device))
        raw_name = _driver.check("cuDeviceGetName", drv.cuDeviceGetName(64, dev))
        raw_bus = _driver.check("cuDeviceGetPCIBusId", drv.cuDeviceGetPCIBusId(64, dev))
        name, bus = (_text(raw_name), _text(raw_bus).lower())
        node = _driver.device_numa_node(device)
        backing = HostTierConfig.model_validate(
            {"quota": "2MiB", "max_quota": "2MiB", "device": device}
        ).resolved_backing
        gpu = {"device": device, "name": name, "bus_id": bus, "numa_node": node, "auto_backing": backing}
        line = f"{name}, bus {bus}, NUMA node {'none' if node is None else node}; backing='auto' picks {backing!r}"
        if node is None and nodes is not None and len(nodes) > 1:
            checks.append(
                Check(
                    f"gpu{device}",
                    "warn",
                    line,
                    "the driver reports no NUMA node for this GPU: set numa_node explicitly",
                    gpu,
                )
            )
        else:
            checks.append(Check(f"gpu{device}", "ok", line, "", gpu))
    return checks


def _older(version: str, than: tuple[int, ...]) -> bool:
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[: len(than)])
    return parts < than


def _text(value: object) -> str:
    return (value.decode(errors="replace") if isinstance(value, bytes) else str(value)).split("\x00")[0].strip()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


# -- the Mooncake tier ----------------------------------------------------------------------------


def check_mooncake(master: str | None = None, timeout: float = 2.0) -> Check:
    """Whether the Mooncake wheel loads here and, given ``host:port``, whether that master answers.

    Only a TCP connect: setting a client up would mount a segment in the cluster.
    """
    from ._mooncake._client import why_unloadable

    why = why_unloadable()
    if why is not None:
        verdict: Verdict = "warn" if master else "skip"
        if "is installed but" in why:  # installing the wheel again would change nothing
            advice = "install what it names, then run 'aiokvtier doctor' again"
        else:
            install = "pip install 'aiokvtier[mooncake]'"
            why = why.removesuffix(f": {install}")  # the advice says it: the line says it once
            advice = f"for a Mooncake tier: {install}"
        return Check("mooncake", verdict, why, advice, {})
    if not master:
        return Check("mooncake", "ok", "the wheel loads (no master given: --mooncake-master HOST:PORT)", "", {})
    import socket

    host, _, port = master.rpartition(":")
    data: dict[str, Any] = {"master": master}
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as exc:
        advice = "start mooncake_master there, or check the address and the firewall"
        return Check("mooncake", "warn", f"the master at {master} does not answer: {exc}", advice, data)
    return Check("mooncake", "ok", f"the wheel loads; the master at {master} answers", "", data)


# -- all of them ----------------------------------------------------------------------------------


# -- the disk tier --------------------------------------------------------------------------------


def _file_system(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str:
    """The type of the file system ``path`` lies on (the longest mount point above it)."""
    best, kind = "", "unknown"
    target = str(path.resolve())
    for line in (_read(mountinfo) or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, line.split(" - ", 1)[1].split()[0]
    return kind


def check_disk(path: Path) -> Check:
    """A disk tier's directory: writable, ``O_DIRECT`` taken, its file system and free space."""
    import tempfile

    from ._disk._io import ALIGN, DataFile

    if not path.is_dir():
        return Check("disk", "fail", f"{path} is not a directory", "create it, or point --disk-path elsewhere", {})
    try:
        probe_dir = tempfile.mkdtemp(prefix=".aiokvtier-doctor-", dir=path)
    except OSError as exc:
        return Check("disk", "fail", f"{path} is not writable: {exc.strerror}", "fix its owner or mode", {})
    try:
        data = DataFile(os.path.join(probe_dir, "probe"), 1, ALIGN)
        direct, why = data.direct, data.direct_why
        data.close()
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    usage = shutil.disk_usage(path)
    kind = _file_system(path)
    figures = {"path": str(path), "file_system": kind, "direct_io": direct, "free_bytes": usage.free}
    summary = f"{path} on {kind}, {format_bytes(usage.free)} free, " + ("O_DIRECT" if direct else "buffered I/O")
    if not direct:
        advice = f"{why}: blocks will also fill the page cache; put the tier on a local ext4 or xfs file system"
        return Check("disk", "warn", summary, advice, figures)
    if kind in ("tmpfs", "ramfs"):
        return Check("disk", "warn", summary, "this is memory, not disk: the tier will not survive a reboot", figures)
    return Check("disk", "ok", summary, "", figures)


def check_platform() -> Check:
    """The kernel: the tier needs Linux (mmap, madvise, mbind through ctypes)."""
    system, release = platform.system(), platform.release()
    data = {"system": system, "release": release, "machine": platform.machine()}
    if system != "Linux":
        return Check("platform", "fail", f"{system} {release}", "aiokvtier needs Linux", data)
    return Check("platform", "ok", f"Linux {release} ({platform.machine()})", "", data)


_CHECKS: tuple[Callable[[], Check | list[Check]], ...] = (
    check_platform,
    check_memory,
    check_virtualization,
    check_populate,
    check_copy_fill,
    check_mbind,
    check_thp,
    check_numa,
    check_memlock,
    check_cuda,
    check_mooncake,
)


def run_checks(*, cuda: bool = True, disk_path: Path | None = None, mooncake_master: str | None = None) -> list[Check]:
    """Every check, in order; ``cuda=False`` leaves the driver alone (no CUDA context is made either way);
    ``disk_path``: also check a disk tier's directory; ``mooncake_master`` (``host:port``): also check
    that a Mooncake master answers there.

    A check that raises is reported as a ``fail`` naming the exception, so one
    broken probe never hides the rest.
    """
    checks: list[Check] = []
    for probe in _CHECKS:
        if probe is check_cuda and not cuda:
            checks.append(Check("cuda", "skip", "not checked (--no-cuda)", "", {}))
            continue
        if platform.system() != "Linux" and probe is not check_platform:
            continue
        try:
            found = check_mooncake(mooncake_master) if probe is check_mooncake else probe()
        except Exception as exc:  # a probe's own bug must not hide the other checks
            name = probe.__name__.removeprefix("check_")
            checks.append(Check(name, "warn", f"the check itself failed: {type(exc).__name__}: {exc}", "", {}))
            continue
        checks.extend(found if isinstance(found, list) else [found])
    if disk_path is not None and platform.system() == "Linux":
        try:
            checks.append(check_disk(disk_path))
        except Exception as exc:  # a probe's own bug must not hide the other checks
            checks.append(Check("disk", "warn", f"the check itself failed: {type(exc).__name__}: {exc}", "", {}))
    return checks
