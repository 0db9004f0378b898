"""The zero-copy (``*_v1``), flat-tensor and pointer calls under attack, with SGLang's own host pools on the
CPU (skipped without SGLang): SGLang's prefetch, backup and scheduler threads at once, ``close()`` and a
killed owner mid-transfer, ``clear()`` racing, two instances over one pool, hostile input, and SGLang's
file backend (``HiCacheFile``) as the reference for every answer and byte."""

from __future__ import annotations

import contextlib
import hashlib
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName, PoolTransfer
except ImportError:
    pytest.skip("sglang is not installed (pip install 'aiokvtier[sglang]')", allow_module_level=True)


from aiokvtier import TierClosedError
from aiokvtier.integrations import sglang as sglang_backend
from aiokvtier.integrations.sglang import REATTACH_AFTER

from .helpers import descriptors
from .sglang_instance import digests, fill_pages, make_host_pool, make_storage, storage_config
from .test_integration_sglang import (
    TIER,
    keys_of,
    owner_took_back,
    page_indices,
    pool_path,
    pool_statistics,
    sglang_threads,
    start_owner,
)
from .test_integration_sglang_v2_attack import JOIN, join_all

__all__ = ["pool_path"]  # the fixture, shared with the SGLang integration tests

ROOT = Path(__file__).resolve().parent.parent


def make_mla_host_pool(layout: str = "page_first", *, page: int = 16, layers: int = 4, tokens: int = 2048) -> Any:
    """SGLang's MLA host KV pool on the CPU (bf16, one latent row of 80 a token and layer)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(
        tokens, page, torch.bfloat16, 64, 16, layers, "cpu", False, start_layer=0, end_layer=layers - 1
    )
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        page,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers - 1,
        target_layer_num=layers,
    )


HOSTS = {
    "mha-page_first": lambda: make_host_pool("page_first"),
    "mha-layer_first": lambda: make_host_pool("layer_first"),
    "mla-page_first": lambda: make_mla_host_pool("page_first"),
    "mla-layer_first": lambda: make_mla_host_pool("layer_first"),
}


def blocks_of(storage: Any) -> int:
    return int(storage.statistics().blocks)


def flat_page(host: Any, page: int) -> torch.Tensor:
    """The flat page tensor SGLang's generic path hands ``batch_set`` (a copy of the page's bytes)."""
    return host.get_data_page(page * host.page_size, flat=True).clone()


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# -- hostile input ------------------------------------------------------------------------------------


def test_hostile_v1_calls_are_refused_by_name_and_store_nothing() -> None:
    host = make_host_pool()
    storage = make_storage(host, TIER)
    ps = host.page_size
    good = page_indices(host, [0, 1])
    fill_pages(host, good, seed=1)
    k = keys_of("hostile", 2)
    cases: dict[str, tuple[Any, Any, type[Exception], str]] = {
        "keys None": (None, good, TypeError, "list of str"),
        "keys a str": ("ab", good, TypeError, "list of str"),
        "a key None": ([k[0], None], good, TypeError, "list of str"),
        "a key bytes": ([k[0], b"b"], good, TypeError, "list of str"),
        "a key twice": ([k[0], k[0]], good, ValueError, "twice"),
        "more keys than indices": ([*k, "third"], good, ValueError, "host indices"),
        "fewer keys than indices": (k[:1], good, ValueError, "host indices"),
        "no keys, indices": ([], good, ValueError, "host indices"),
        "indices None": (k, None, TypeError, "torch.Tensor"),
        "indices a list": (k, good.tolist(), TypeError, "torch.Tensor"),
        "indices float": (k, good.double(), TypeError, "integer"),
        "indices 2-D": (k, good.reshape(2, ps), ValueError, "1-D"),
        "indices 0-D": ([], torch.tensor(0), ValueError, "1-D"),
        "indices negative": (k, good - ps, ValueError, "outside"),
        "indices past the pool": (k, good + host.size, ValueError, "outside"),
        "indices not page-aligned": (k, good + 1, ValueError, "whole pages"),
        "indices reversed": (k, good.flip(0), ValueError, "whole pages"),
    }
    try:
        for name, (keys, indices, error, words) in cases.items():
            for call in (storage.batch_set_v1, storage.batch_get_v1):
                if name == "a key twice" and call == storage.batch_get_v1:
                    continue  # loading one page into two places is allowed (below)
                with pytest.raises(error, match=words):
                    call(keys, indices)
            assert blocks_of(storage) == 0, name
        # Views with odd strides and narrower integer dtypes name the same pages.
        odd = torch.stack([good, good], dim=1)[:, 0].to(torch.int32)
        assert storage.batch_set_v1(k, odd) == [True, True]
        twice = page_indices(host, [4, 5])
        assert storage.batch_get_v1([k[1], k[1]], twice) == [True, True]
        assert digests(host, twice) == [digests(host, good)[1]] * 2
        with pytest.raises(ValueError, match="overlap"):  # one page loaded twice into one place
            storage.batch_get_v1(k, torch.cat([twice[:ps], twice[:ps]]))
    finally:
        storage.close()


def test_hostile_flat_calls_are_refused_by_name_and_store_nothing() -> None:
    host = make_host_pool()
    storage = make_storage(host, TIER, v1=False)
    fill_pages(host, page_indices(host, [0]), seed=2)
    page = flat_page(host, 0)
    k = keys_of("flat-hostile", 2)
    cases: dict[str, tuple[Any, type[Exception], str]] = {
        "a page of no bytes": (lambda: storage.set(k[0], torch.empty(0, dtype=torch.float16)), ValueError, "bytes"),
        "pages of no bytes": (lambda: storage.batch_set(k, [page[:0], page[:0]]), ValueError, "bytes"),
        "a key twice": (lambda: storage.batch_set([k[0], k[0]], [page, page.clone()]), ValueError, "twice"),
        "a key None": (lambda: storage.batch_set([None], [page]), TypeError, "list of str"),
        "keys a str": (lambda: storage.batch_set("ab", [page, page]), TypeError, "list of str"),
        "more keys than pages": (lambda: storage.batch_set(k, [page]), ValueError, "2 keys but 1"),
        "pages of two sizes": (lambda: storage.batch_set(k, [page, page[:8]]), ValueError, "one size"),
        "a page not a tensor": (lambda: storage.set(k[0], b"bytes"), ValueError, "CPU tensor"),
        "a page on another device": (lambda: storage.set(k[0], page.to("meta")), ValueError, "CPU tensor"),
        "no page": (lambda: storage.set(k[0]), ValueError, "positive ints"),
        "a size of 0": (lambda: storage.set(k[0], target_location=page.data_ptr(), target_sizes=0), ValueError, ""),
        "an address of 0": (lambda: storage.set(k[0], target_location=0, target_sizes=64), ValueError, ""),
        "a size a tensor": (
            lambda: storage.set(k[0], target_location=page.data_ptr(), target_sizes=torch.tensor(64)),
            ValueError,
            "positive ints",
        ),
        "sizes for one key of two": (
            lambda: storage.batch_set(k, None, [page.data_ptr()] * 2, [64]),
            ValueError,
            "one size",
        ),
    }
    try:
        for name, (call, error, words) in cases.items():
            with pytest.raises(error, match=words):
                call()
            assert blocks_of(storage) == 0, name
        # A target that is not contiguous is refused (the bytes would land in a copy), nothing loaded.
        assert storage.set(k[0], page)
        odd = torch.zeros(2 * page.numel(), dtype=page.dtype)[::2]
        with pytest.raises(ValueError, match="contiguous"):
            storage.get(k[0], odd)
        assert not bool(odd.any())
        # A source view with odd strides is stored as its elements in order.
        strided = torch.stack([page, torch.zeros_like(page)], dim=1)[:, 0]
        assert storage.set(k[1], strided)
        out = torch.zeros_like(page)
        assert storage.get(k[1], out) is out and tensor_digest(out) == tensor_digest(page)
    finally:
        storage.close()


@pytest.mark.parametrize("op", ["set", "get"])
def test_a_pointer_outside_this_process_memory_is_refused_not_a_crash(op: str) -> None:
    """The pointer form names memory by address: one that is not mapped (or not writable, for a load) in
    this process is refused with an error, where a ``memmove`` would kill the process. Run in a child."""
    code = f"""
import sys, mmap, numpy, torch
sys.path.insert(0, {str(ROOT)!r})
from tests.sglang_instance import make_host_pool, make_storage
host = make_host_pool()
storage = make_storage(host, {{"tier": {{"quota": "64MiB", "slot_size": "16KiB"}}}}, v1=False)
page = torch.arange(1024, dtype=torch.int32)
assert storage.set("k", target_location=page.data_ptr(), target_sizes=4096)
ro = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
ro_address = numpy.frombuffer(ro, dtype=numpy.uint8).ctypes.data  # mapped, read-only
for address, size in ((4096, 4096), (1 << 46, 4096), (page.data_ptr(), 1 << 40)) + (
    ((ro_address, 4096),) if {op!r} == "get" else ()
):
    try:
        if {op!r} == "set":
            storage.set("bad", target_location=address, target_sizes=size)
        else:
            storage.get("k", target_location=address, target_sizes=size)
    except ValueError as exc:
        print("refused:", exc, flush=True)
    else:
        print("accepted", address, size, flush=True)
print("blocks", storage.statistics().blocks, flush=True)
storage.close()
"""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("refused:")] == [
        line for line in lines if line.startswith(("refused:", "accepted"))
    ], lines
    assert "blocks 1" in lines, lines


def test_a_pointer_running_past_the_end_of_sglangs_host_pool_is_refused() -> None:
    """An address inside SGLang's host pool with a size that runs past the pool's buffer would read (or
    overwrite) whatever memory follows it: refused, nothing stored or written."""
    host = make_host_pool()
    storage = make_storage(host, TIER, v1=False)
    buffer = host.kv_buffer
    end = buffer.data_ptr() + buffer.numel() * buffer.element_size()
    try:
        with pytest.raises(ValueError, match="past the end"):
            storage.set("over", target_location=end - 64, target_sizes=4096)
        assert blocks_of(storage) == 0
        page = torch.arange(1024, dtype=torch.int32)
        assert storage.set("k", target_location=page.data_ptr(), target_sizes=4096)
        with pytest.raises(ValueError, match="past the end"):
            storage.get("k", target_location=end - 64, target_sizes=4096)
        assert storage.set("inside", target_location=end - 4096, target_sizes=4096)  # the last bytes: fine
    finally:
        storage.close()


def test_pointers_into_sglangs_host_pool_skip_the_memory_map_others_read_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory map (``/proc/self/maps``, 1.5 ms in a process with torch loaded) is read only for
    pointers outside SGLang's host pool: its own pages, the usual call, cost no read of it."""
    host = make_host_pool()
    storage = make_storage(host, TIER, v1=False)
    reads: list[int] = []
    unmapped = sglang_backend._unmapped
    monkeypatch.setattr(
        sglang_backend, "_unmapped", lambda spans, **kw: reads.append(len(spans)) or unmapped(spans, **kw)
    )
    buffer = host.kv_buffer
    start = buffer.data_ptr()
    try:
        assert storage.set("in", target_location=start, target_sizes=4096)
        assert storage.get("in", target_location=start + 4096, target_sizes=4096)
        assert reads == []
        page = torch.arange(1024, dtype=torch.int32)
        assert storage.set("out", target_location=page.data_ptr(), target_sizes=4096)
        assert reads == [1]
    finally:
        storage.close()


# -- SGLang's file backend as the reference ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_flat_calls_answer_as_sglangs_file_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Random sequences of ``set``/``batch_set``/``exists``/``batch_exists``/``get``/``batch_get`` over a key
    universe, the same against ``HiCacheFile``: which keys hit and the bytes loaded agree (``batch_get``
    answers the leading run, as SGLang's generic prefetch reads it)."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    rng = random.Random(seed)
    host = HOSTS[rng.choice(sorted(HOSTS))]()
    ours = make_storage(host, TIER, v1=False)
    reference = HiCacheFile(storage_config(TIER, v1=False))
    reference.register_mem_pool_host(host)
    try:
        universe = keys_of(f"diff{seed}", 10)
        fill_pages(host, page_indices(host, list(range(10))), seed=seed)
        pages = {key: flat_page(host, i) for i, key in enumerate(universe)}
        for step in range(40):
            op = rng.choice(["set", "batch_set", "exists", "batch_exists", "get", "batch_get"])
            keys = rng.sample(universe, rng.randrange(1, 5))
            if op == "set":
                got = [b.set(keys[0], pages[keys[0]]) for b in (ours, reference)]
            elif op == "batch_set":
                got = [b.batch_set(keys, [pages[k] for k in keys]) for b in (ours, reference)]
            elif op == "exists":
                got = [b.exists(keys[0]) for b in (ours, reference)]
            elif op == "batch_exists":
                got = [b.batch_exists(keys) for b in (ours, reference)]
            else:
                answers = []
                for b in (ours, reference):
                    targets = [host.get_dummy_flat_data_page() for _ in keys]
                    if op == "get":
                        out = [b.get(keys[0], targets[0])]
                    else:
                        out = b.batch_get(keys, targets)
                    lead = next((i for i, t in enumerate(out) if t is None), len(out))
                    answers.append((lead, [tensor_digest(t) for t in out[:lead]]))
                    assert all(t is targets[i] for i, t in enumerate(out[:lead]))
                got = answers
            assert got[0] == got[1], (step, op, keys, got)
        for key in universe:  # every byte loaded is the page stored
            out = host.get_dummy_flat_data_page()
            if ours.get(key, out) is not None:
                assert tensor_digest(out) == tensor_digest(pages[key])
    finally:
        ours.close()
        reference.clear()


@pytest.mark.parametrize("seed", range(4))
def test_v1_calls_answer_as_sglangs_file_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """``batch_set_v1``/``batch_get_v1``/``batch_exists`` against ``HiCacheFile``'s page calls for the same
    pages (its KV transfers: it has no ``*_v1`` calls), MHA and MLA, both layouts: the same keys hit, and
    the pages loaded into SGLang's host pool are the same bytes."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    rng = random.Random(seed)
    name = sorted(HOSTS)[seed % len(HOSTS)]
    host = HOSTS[name]()
    ours = make_storage(host, TIER)
    reference = HiCacheFile(storage_config(TIER))
    reference.register_mem_pool_host(host)
    reference.register_mem_host_pool_v2(host, PoolName.KV)
    try:
        universe = keys_of(f"v1diff{seed}", 8)
        fill_pages(host, page_indices(host, list(range(8))), seed=seed)
        want = digests(host, page_indices(host, list(range(8))))
        for step in range(24):
            keys = rng.sample(universe, rng.randrange(1, 5))
            src = page_indices(host, [universe.index(k) for k in keys])
            op = rng.choice(["set", "exists", "get"])
            if op == "set":
                transfer = PoolTransfer(name=PoolName.KV, host_indices=src, keys=keys)
                got = [ours.batch_set_v1(keys, src), reference.batch_set_v2([transfer])[PoolName.KV]]
            elif op == "exists":
                got = [ours.batch_exists(keys), reference.batch_exists(keys)]
            else:
                dst = page_indices(host, list(range(16, 16 + len(keys))))
                leads = []
                kv = [PoolTransfer(name=PoolName.KV, host_indices=dst, keys=keys)]
                for load in (
                    lambda keys=keys, dst=dst: ours.batch_get_v1(keys, dst),
                    lambda kv=kv: reference.batch_get_v2(kv)[PoolName.KV],
                ):
                    fill_pages(host, dst, seed=999)  # stale bytes a miss would leave
                    answer = load()
                    lead = answer.index(False) if False in answer else len(answer)
                    leads.append((lead, digests(host, dst)[:lead]))
                got = leads
                assert got[0][1] == [want[universe.index(k)] for k in keys[: got[0][0]]]
            assert got[0] == got[1], (name, step, op, keys, got)
    finally:
        ours.close()
        reference.clear()


# -- SGLang's threads at once ------------------------------------------------------------------------


@pytest.mark.parametrize("host_kind", ["mha-page_first", "mla-layer_first"])
@pytest.mark.parametrize("where", ["tier", "pool"])
def test_prefetch_backup_and_scheduler_threads_at_once_overlapping_keys(
    where: str, host_kind: str, request: pytest.FixtureRequest
) -> None:
    """Two backup threads store pages of one key universe (overlapping: each key always from the same
    page), two prefetch threads ask ``batch_exists`` and load what it found, a scheduler thread drains
    ``get_stats``, many rounds: every call returns, every page loaded is the stored bytes, a thread sees
    what it stored, and the drained figures add up to the pages stored and loaded."""
    section = TIER if where == "tier" else {"pool": request.getfixturevalue("pool_path")}
    host = HOSTS[host_kind]()
    storage = make_storage(host, section)
    universe = keys_of(f"{where}-{host_kind}", 24)
    fill_pages(host, page_indices(host, list(range(24))), seed=5)
    want = dict(zip(universe, digests(host, page_indices(host, list(range(24)))), strict=True))
    targets = [page_indices(host, list(range(32 + 8 * n, 40 + 8 * n))) for n in range(2)]
    errors: list[BaseException] = []
    asked_to_store = [0, 0]
    loaded = [0, 0]
    drained: list[Any] = []
    stop = threading.Event()

    def backup(n: int) -> None:
        rng = random.Random(n)
        try:
            for _ in range(30):
                keys = rng.sample(universe, rng.randrange(1, 7))
                src = page_indices(host, [universe.index(k) for k in keys])
                assert storage.batch_set_v1(keys, src) == [True] * len(keys)
                asked_to_store[n] += len(keys)
                assert storage.batch_exists(keys) == len(keys)  # nothing evicts or clears here
        except BaseException as exc:
            errors.append(exc)

    def prefetch(n: int) -> None:
        rng = random.Random(100 + n)
        try:
            for _ in range(30):
                keys = rng.sample(universe, rng.randrange(1, 7))
                hit = storage.batch_exists(keys)
                assert 0 <= hit <= len(keys)
                dst = targets[n][: len(keys) * host.page_size]
                got = storage.batch_get_v1(keys, dst)
                lead = got.index(False) if False in got else len(got)
                assert got == [True] * lead + [False] * (len(keys) - lead)
                assert lead >= hit  # what batch_exists found stays (nothing evicts)
                assert digests(host, dst)[:lead] == [want[k] for k in keys[:lead]]
                loaded[n] += lead
        except BaseException as exc:
            errors.append(exc)

    def scheduler() -> None:
        try:
            while not stop.is_set():
                drained.append(storage.get_stats())
                time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=backup, args=(n,)) for n in range(2)]
    threads += [threading.Thread(target=prefetch, args=(n,)) for n in range(2)]
    watcher = threading.Thread(target=scheduler)
    try:
        for t in [*threads, watcher]:
            t.start()
        join_all(threads)
        stop.set()
        join_all([watcher])
        assert not errors, errors
        drained.append(storage.get_stats())
        assert sum(sum(s.backup_pgs) for s in drained) == sum(asked_to_store)
        assert sum(sum(s.prefetch_pgs) for s in drained) == sum(loaded)
        assert all(len(s.backup_pgs) == len(s.backup_bandwidth) for s in drained)
        assert storage.batch_exists(universe) == 24 or where == "tier"  # a page no thread drew is a miss
    finally:
        stop.set()
        storage.close()
    assert sglang_threads() == []
    if where == "pool":
        stats = owner_took_back(section["pool"])
        assert stats.claims == 0 and stats.blocks_pinned == 0


def test_a_second_close_returns_only_once_the_first_has_released_everything(pool_path: str) -> None:
    """Two threads close at once while large stores run: each close returns only once the storage is
    closed whole (its loop's thread ended, the pool detached), the second too, not as soon as it sees
    that the first began."""
    host = make_host_pool(tokens=8192)
    src = page_indices(host, list(range(512)))
    fill_pages(host, src, seed=3)
    for attempt in range(5):
        storage = make_storage(host, {"pool": pool_path})
        assert storage.batch_set_v1(keys_of(f"warm-{attempt}", 8), src[: 8 * len(src) // 512]) == [True] * 8

        def move(storage: Any = storage, attempt: int = attempt) -> None:
            with contextlib.suppress(TierClosedError):
                storage.batch_set_v1(keys_of(f"second-{attempt}", 512), src)

        movers = [threading.Thread(target=move) for _ in range(2)]
        for mover in movers:
            mover.start()
        time.sleep(0.002)
        left: list[list[str]] = []

        def close(storage: Any = storage, left: list[list[str]] = left) -> None:
            storage.close()
            left.append(sglang_threads())  # the moment this close returned

        closers = [threading.Thread(target=close) for _ in range(2)]
        for closer in closers:
            closer.start()
        join_all([*closers, *movers])
        assert left == [[], []], f"a close() returned while the storage's thread still ran: {left}"


# -- close racing large transfers --------------------------------------------------------------------


@pytest.mark.parametrize("op", ["batch_set_v1", "batch_get_v1"])
@pytest.mark.parametrize("where", ["tier", "pool"])
def test_close_racing_large_transfers_at_swept_delays(where: str, op: str, request: pytest.FixtureRequest) -> None:
    """Two threads move 256 pages (16 MiB) each while ``close()`` comes after 0 to 20 ms: close returns,
    each call returns or raises ``TierClosedError``, nothing reads or writes SGLang's host pool after
    (bytes written there after close stay, and no page stored is other than its source), no thread or
    descriptor is left, the pool holds no claim or pin, and later calls say closed."""
    section = TIER if where == "tier" else {"pool": request.getfixturevalue("pool_path")}
    host = make_host_pool(tokens=8192)  # 1,024 host pages of 64 KiB
    srcs = [page_indices(host, list(range(256 * n, 256 * (n + 1)))) for n in range(2)]
    dsts = [page_indices(host, list(range(512 + 256 * n, 512 + 256 * (n + 1)))) for n in range(2)]
    for n, src in enumerate(srcs):
        fill_pages(host, src, seed=40 + n)
    sources = [digests(host, src) for src in srcs]
    fds = descriptors()
    interrupted = 0
    for attempt, delay in enumerate([0.0, 0.001, 0.003, 0.006, 0.01, 0.02]):
        keys = [keys_of(f"close-{where}-{op}-{attempt}-{n}", 256) for n in range(2)]
        storage = make_storage(host, section)
        if op == "batch_get_v1":
            for n in range(2):
                assert storage.batch_set_v1(keys[n], srcs[n]) == [True] * 256
        outcomes: list[Any] = []

        def run(n: int, storage: Any = storage, keys: list[list[str]] = keys, outcomes: list[Any] = outcomes) -> None:
            try:
                index = srcs[n] if op == "batch_set_v1" else dsts[n]
                outcomes.append(getattr(storage, op)(keys[n], index))
            except Exception as exc:
                outcomes.append(exc)

        workers = [threading.Thread(target=run, args=(n,)) for n in range(2)]
        for w in workers:
            w.start()
        time.sleep(delay)
        closing = threading.Thread(target=storage.close)
        closing.start()
        join_all([closing, *workers])
        for outcome in outcomes:
            if isinstance(outcome, TierClosedError):
                interrupted += 1
                assert "interrupted by close()" in str(outcome) or "is closed" in str(outcome)
            else:
                assert outcome == [True] * 256, outcome
        # Nothing copies any more: bytes written now stay, and no late copy reads the sources.
        for index in (*srcs, *dsts):
            fill_pages(host, index, seed=7)
        after = [digests(host, index) for index in (*srcs, *dsts)]
        time.sleep(0.05)
        assert [digests(host, index) for index in (*srcs, *dsts)] == after
        for n, src in enumerate(srcs):
            fill_pages(host, src, seed=40 + n)
        with pytest.raises(TierClosedError, match="closed"):
            storage.batch_get_v1(keys[0][:1], dsts[0][: host.page_size])
        with pytest.raises(TierClosedError, match="closed"):
            storage.batch_exists(keys[0])
        assert storage.get_stats() is not None
        storage.close()  # idempotent
        assert sglang_threads() == []
        if where == "pool":
            stats = owner_took_back(section["pool"])
            assert stats.clients == 1 and stats.claims == 0 and stats.blocks_pinned == 0
            # Every page stored is its source, whole (a page whose copy had not landed is never visible).
            reader = make_storage(host, section)
            try:
                for n in range(2):
                    got = reader.batch_get_v1(keys[n], dsts[n])
                    lead = got.index(False) if False in got else 256
                    assert digests(host, dsts[n])[:lead] == sources[n][:lead]
            finally:
                reader.close()
    assert descriptors() == fds
    assert interrupted, "no close landed during a copy"


# -- a killed owner ----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["batch_set_v1", "batch_get_v1"])
def test_an_owner_killed_mid_v1_transfer_is_a_miss_then_the_new_pool_is_used(tmp_path: Path, op: str) -> None:
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path)
    host = make_host_pool(tokens=8192)
    src, dst = page_indices(host, list(range(128))), page_indices(host, list(range(512, 640)))
    fill_pages(host, src, seed=31)
    storage = make_storage(host, {"pool": path})
    keys = keys_of(f"killed-{op}", 128)
    seen: list[Any] = []
    stop = threading.Event()

    def calls() -> None:  # SGLang's thread keeps moving 8 MiB batches while the owner dies
        try:
            while not stop.is_set():
                seen.append(getattr(storage, op)(keys, src if op == "batch_set_v1" else dst))
        except BaseException as exc:
            seen.append(exc)

    worker = threading.Thread(target=calls)
    try:
        assert storage.batch_set_v1(keys, src) == [True] * 128
        worker.start()
        time.sleep(0.1)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while storage.batch_exists(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        join_all([worker])
        assert not [s for s in seen if isinstance(s, BaseException)], seen
        assert all(s == [True] * 128 or s == [False] * 128 for s in seen), seen
        assert seen[-1] == [False] * 128
        # The calls are over: nothing writes SGLang's pages any more.
        fill_pages(host, dst, seed=3)
        before = digests(host, dst)
        assert storage.batch_exists(keys) == 0
        assert storage.batch_set_v1(keys, src) == [False] * 128
        assert storage.batch_get_v1(keys, dst) == [False] * 128
        time.sleep(0.05)
        assert digests(host, dst) == before

        owner = start_owner(path)  # a restarted owner starts empty
        time.sleep(REATTACH_AFTER + 0.2)
        assert storage.batch_exists(keys) == 0
        assert storage.batch_set_v1(keys, src) == [True] * 128
        assert storage.batch_get_v1(keys, dst) == [True] * 128
        assert digests(host, dst) == digests(host, src)
        assert pool_statistics(path).blocks == 128 * 2  # the new pool holds them
    finally:
        stop.set()
        if worker.is_alive():
            worker.join(JOIN)
        storage.close()
        assert owner.stdin is not None
        owner.stdin.close()
        owner.wait(timeout=30)
    assert sglang_threads() == []


# -- clear, and two instances over one pool ----------------------------------------------------------


@pytest.mark.parametrize("where", ["tier", "pool"])
def test_clear_racing_stores_and_loads(where: str, request: pytest.FixtureRequest) -> None:
    """``clear()`` from the scheduler thread while two threads store and load: every call returns, a page
    loaded is its bytes, and after a last clear a tier holds nothing (a pool: clear is a no-op)."""
    section = TIER if where == "tier" else {"pool": request.getfixturevalue("pool_path")}
    host = make_host_pool()
    storage = make_storage(host, section)
    universe = keys_of(f"clear-{where}", 16)
    fill_pages(host, page_indices(host, list(range(16))), seed=8)
    want = dict(zip(universe, digests(host, page_indices(host, list(range(16)))), strict=True))
    errors: list[BaseException] = []
    stop = threading.Event()

    def work(n: int) -> None:
        rng = random.Random(n)
        dst = page_indices(host, list(range(32 + 8 * n, 40 + 8 * n)))
        try:
            for _ in range(40):
                keys = rng.sample(universe, rng.randrange(1, 6))
                stored = storage.batch_set_v1(keys, page_indices(host, [universe.index(k) for k in keys]))
                assert all(type(s) is bool for s in stored) and len(stored) == len(keys)
                got = storage.batch_get_v1(keys, dst[: len(keys) * host.page_size])
                lead = got.index(False) if False in got else len(got)
                assert digests(host, dst)[:lead] == [want[k] for k in keys[:lead]]
        except BaseException as exc:
            errors.append(exc)

    def clearing() -> None:
        try:
            while not stop.is_set():
                storage.clear()
                time.sleep(0.002)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(2)]
    clearer = threading.Thread(target=clearing)
    try:
        for t in [*threads, clearer]:
            t.start()
        join_all(threads)
        stop.set()
        join_all([clearer])
        assert not errors, errors
        assert storage.batch_set_v1(universe[:2], page_indices(host, [0, 1])) == [True, True]
        storage.clear()
        assert storage.batch_exists(universe[:2]) == (0 if where == "tier" else 2)
        if where == "tier":
            assert blocks_of(storage) == 0
    finally:
        stop.set()
        storage.close()


def test_two_instances_over_one_pool_share_keys_and_one_closes_while_the_other_works(pool_path: str) -> None:
    host = make_host_pool()
    first, second = make_storage(host, {"pool": pool_path}), make_storage(host, {"pool": pool_path})
    universe = keys_of("two", 16)
    fill_pages(host, page_indices(host, list(range(16))), seed=12)
    want = dict(zip(universe, digests(host, page_indices(host, list(range(16)))), strict=True))
    errors: list[BaseException] = []
    closed = threading.Event()

    def work(storage: Any, n: int, may_close: bool) -> None:
        rng = random.Random(n)
        dst = page_indices(host, list(range(32 + 8 * n, 40 + 8 * n)))
        try:
            for _ in range(40):
                keys = rng.sample(universe, rng.randrange(1, 6))
                try:
                    assert storage.batch_set_v1(keys, page_indices(host, [universe.index(k) for k in keys])) == [
                        True
                    ] * len(keys)
                    assert storage.batch_exists(keys) == len(keys)
                    got = storage.batch_get_v1(keys, dst[: len(keys) * host.page_size])
                except TierClosedError:
                    assert may_close and closed.is_set()
                    return
                assert got == [True] * len(keys)
                assert digests(host, dst)[: len(keys)] == [want[k] for k in keys]
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(first, 0, True)),
        threading.Thread(target=work, args=(second, 1, False)),
        threading.Thread(target=work, args=(second, 2, False)),
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(0.05)
        closed.set()
        first.close()
        join_all(threads)
        assert not errors, errors
        assert second.batch_exists(universe) in range(17)
    finally:
        first.close()
        second.close()
    stats = owner_took_back(pool_path)
    assert stats.claims == 0 and stats.blocks_pinned == 0


def test_close_racing_the_attach_to_a_restarted_owner_leaves_nothing(tmp_path: Path) -> None:
    """The first call after an owner came back attaches again on the storage's loop; ``close()`` at swept
    delays into it (during the attach, the old pool's close, the store) leaves no thread, descriptor or
    mapping of either pool behind."""
    path = str(tmp_path / "pool.sock")
    host = make_host_pool()
    keys, src = keys_of("reattach", 4), page_indices(host, [0, 1, 2, 3])
    fds = descriptors()  # before any owner: its pipes are closed with it
    owner = start_owner(path)
    try:
        for delay in (0.0, 0.002, 0.02):
            storage = make_storage(host, {"pool": path})
            assert storage.batch_set_v1(keys, src) == [True] * 4
            owner.kill()
            owner.wait()
            ended(owner)
            deadline = time.monotonic() + 10
            while storage.batch_exists(keys) and time.monotonic() < deadline:
                time.sleep(0.01)
            owner = start_owner(path)
            time.sleep(REATTACH_AFTER + 0.05)
            outcome: list[Any] = []

            def store(storage: Any = storage, outcome: list[Any] = outcome) -> None:
                try:
                    outcome.append(storage.batch_set_v1(keys, src))
                except TierClosedError as exc:
                    outcome.append(exc)

            worker = threading.Thread(target=store)
            worker.start()
            time.sleep(delay)
            storage.close()
            join_all([worker])
            assert isinstance(outcome[0], TierClosedError) or outcome[0] == [True] * 4, outcome
            assert sglang_threads() == []
            stats = owner_took_back(path)
            assert stats.claims == 0 and stats.blocks_pinned == 0
    finally:
        assert owner.stdin is not None
        owner.stdin.close()
        owner.wait(timeout=30)
        ended(owner)
    assert descriptors() == fds


def ended(owner: subprocess.Popen[str]) -> None:
    """Close the pipes to an owner that exited (they are this process's descriptors)."""
    for pipe in (owner.stdin, owner.stdout):
        if pipe is not None:
            pipe.close()
