"""A pool's GPU arm through imported driver handles (GPU machine): one owner creates pinned host units with
``cuMemCreate`` (POSIX file descriptors) and streams them over a Unix socket to N processes, each of which
imports and maps every unit (``cuMemImportFromShareableHandle``, ``cuMemMap``, ``cuMemSetAccess``) while a
driver probe times its other calls. Reports the owner's create rate, the rate at which the pool became usable
in every process, every probe's worst stall and blocked fraction, and checks each unit's marker on the CPU and
the GPU of every process. The alternative to each process registering the shared memory itself
(``bench cuda --sections executor_responsiveness``, arm ``8_processes_one_pool``).

    PYTHONPATH=. python benchmarks/pool_import_probe.py --gib 48 --procs 8 --threads 1 8 --out res.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import queue
import socket
import struct
import tempfile
import threading
import time
from typing import Any

UNIT = 64 << 20
END = (1 << 64) - 1


def _child(rank: int, path: str, size: int, device: int, out: Any) -> None:
    from aiokvtier._cuda._backings import gpu_and_cpu_access
    from aiokvtier._cuda._driver import PrimaryContext, check, driver
    from aiokvtier.bench._probe import Probe

    try:
        drv = driver()
        ctx = PrimaryContext(device)
        ctx.make_current()
        dptr = check("cuMemAlloc", drv.cuMemAlloc(1 << 20))
        base = int(check("cuMemAddressReserve", drv.cuMemAddressReserve(size, UNIT, 0, 0)))
        access = gpu_and_cpu_access(device)
        fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handles: list[tuple[int, Any]] = []
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        with Probe(ctx, int(dptr)) as probe:
            out.put(("ready", rank, None))
            started = None
            per_unit: list[float] = []
            while True:
                msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
                offset, length = struct.unpack("QQ", msg)
                if offset == END:
                    break
                if started is None:
                    started = time.perf_counter()
                t0 = time.perf_counter()
                handle = check("cuMemImportFromShareableHandle", drv.cuMemImportFromShareableHandle(fds[0], fd_type))
                os.close(fds[0])
                check("cuMemMap", drv.cuMemMap(base + offset, length, 0, handle, 0))
                check("cuMemSetAccess", drv.cuMemSetAccess(base + offset, length, access, len(access)))
                handles.append((offset, handle))
                per_unit.append(time.perf_counter() - t0)
            done = time.perf_counter()
        # Check: the CPU reads the owner's marker; the GPU copies it back.
        bad = 0
        host = (ctypes.c_uint64 * 1)()
        for offset, _ in handles:
            cpu = ctypes.c_uint64.from_address(base + offset).value
            check("cuMemcpyDtoH", drv.cuMemcpyDtoH(ctypes.addressof(host), base + offset, 8))
            bad += cpu != offset + 1 or host[0] != offset + 1
        t_close = time.perf_counter()
        for offset, handle in handles:
            check("cuMemUnmap", drv.cuMemUnmap(base + offset, UNIT))
            check("cuMemRelease", drv.cuMemRelease(handle))
        check("cuMemAddressFree", drv.cuMemAddressFree(base, size))
        close_s = time.perf_counter() - t_close
        wall = done - (started or done)
        row = probe.report(wall, started) if started else probe.report(0.0)
        per_unit.sort()
        out.put(
            (
                "report",
                rank,
                {
                    "rank": rank,
                    "units": len(handles),
                    "bad_markers": int(bad),
                    "import_wall_s": round(wall, 4),
                    "import_ms_p50": round(per_unit[len(per_unit) // 2] * 1e3, 3) if per_unit else None,
                    "import_ms_max": round(per_unit[-1] * 1e3, 3) if per_unit else None,
                    "close_s": round(close_s, 4),
                    "done_at": time.clock_gettime(time.CLOCK_MONOTONIC),
                    **row,
                },
            )
        )
        drv.cuMemFree(dptr)
        ctx.release()
    except BaseException as exc:
        out.put(("error", rank, repr(exc)))
        raise


def _collect(out: Any, n: int, kind: str, timeout: float) -> dict[int, Any]:
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < n:
        try:
            what, rank, body = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"{n - len(got)} processes did not say {kind}") from None
        if what == "error":
            raise RuntimeError(f"process {rank}: {body}")
        got[rank] = body
    return got


def arm(size: int, procs: int, threads: int, device: int, node: int) -> dict[str, Any]:
    from aiokvtier._cuda._backings import VmmBacking, gpu_and_cpu_access
    from aiokvtier._cuda._driver import PrimaryContext, check, driver
    from aiokvtier.bench._probe import Probe

    ctx_mp = mp.get_context("spawn")
    out = ctx_mp.Queue()
    directory = tempfile.mkdtemp(prefix="import-probe-")
    path = os.path.join(directory, "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(procs)
    children = [ctx_mp.Process(target=_child, args=(r, path, size, device, out)) for r in range(procs)]
    for c in children:
        c.start()
    conns = [listener.accept()[0] for _ in children]
    _collect(out, procs, "ready", 300)
    drv = driver()
    ctx = PrimaryContext(device)
    ctx.make_current()
    dptr = check("cuMemAlloc", drv.cuMemAlloc(1 << 20))
    base = int(check("cuMemAddressReserve", drv.cuMemAddressReserve(size, UNIT, 0, 0)))
    access = gpu_and_cpu_access(device)
    prop = VmmBacking.prop(node, exportable=True)
    fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    units: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    for off in range(0, size, UNIT):
        units.put(off)
    for _ in range(threads):
        units.put(None)
    send_lock = threading.Lock()  # units go to every child in one order per connection
    handles: list[tuple[int, Any]] = []
    create_ms: list[float] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            ctx.make_current()
            while (off := units.get()) is not None:
                t0 = time.perf_counter()
                handle = check("cuMemCreate", drv.cuMemCreate(UNIT, prop, 0))
                check("cuMemMap", drv.cuMemMap(base + off, UNIT, 0, handle, 0))
                check("cuMemSetAccess", drv.cuMemSetAccess(base + off, UNIT, access, len(access)))
                ctypes.c_uint64.from_address(base + off).value = off + 1
                fd = int(check("cuMemExportToShareableHandle", drv.cuMemExportToShareableHandle(handle, fd_type, 0)))
                create_ms.append((time.perf_counter() - t0) * 1e3)
                with send_lock:
                    handles.append((off, handle))
                    for conn in conns:
                        socket.send_fds(conn, [struct.pack("QQ", off, UNIT)], [fd])
                os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    with Probe(ctx, int(dptr)) as probe:
        opened = time.clock_gettime(time.CLOCK_MONOTONIC)
        t_start = time.perf_counter()
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        owner_s = time.perf_counter() - t_start
        for conn in conns:
            conn.send(struct.pack("QQ", END, 0))
        reports = _collect(out, procs, "report", 900)
        owner_probe = probe.report(owner_s, t_start)
    for c in children:
        c.join(60)
    for off, handle in handles:
        drv.cuMemUnmap(base + off, UNIT)
        drv.cuMemRelease(handle)
    drv.cuMemAddressFree(base, size)
    drv.cuMemFree(dptr)
    ctx.release()
    for conn in conns:
        conn.close()
    listener.close()
    if errors:
        raise errors[0]
    rows = [reports[r] for r in sorted(reports)]
    wall = max(r.pop("done_at") for r in rows) - opened
    create_ms.sort()
    return {
        "gib": size / 2**30,
        "procs": procs,
        "owner_threads": threads,
        "owner_create_s": round(owner_s, 3),
        "owner_gib_s": round(size / 2**30 / owner_s, 2),
        "owner_unit_ms_p50": round(create_ms[len(create_ms) // 2], 2),
        "owner_unit_ms_max": round(create_ms[-1], 2),
        "usable_everywhere_s": round(wall, 3),
        "usable_everywhere_gib_s": round(size / 2**30 / wall, 2),
        "worst_stall_ms": max(r["worst_stall_ms"] for r in rows),
        "blocked_fraction_max": max(r["blocked_fraction"] for r in rows),
        "p99_ms_max": max(r["p99_ms"] for r in rows),
        "bad_markers": sum(r["bad_markers"] for r in rows),
        "owner_probe": owner_probe,
        "per_process": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=48)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--node", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    size = int(a.gib * 2**30) // UNIT * UNIT
    results = []
    for threads in a.threads:
        time.sleep(5)  # let the host take back the last arm's memory
        r = arm(size, a.procs, threads, a.device, a.node)
        print(json.dumps({k: v for k, v in r.items() if k != "per_process"}), flush=True)
        results.append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
