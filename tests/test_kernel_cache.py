"""The SM copy kernel is compiled once per machine: the cubin is kept in the cache directory.

No NVRTC or GPU needed: the compiler is replaced by a counter that returns an ELF image.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from aiokvtier._cuda import _kernel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[_kernel.KernelSpec]:
    calls: list[_kernel.KernelSpec] = []

    def fake(spec: _kernel.KernelSpec, source: str | None = None) -> bytes:
        calls.append(spec)
        return b"\x7fELF" + spec.arch.encode() + bytes([len(calls)])

    monkeypatch.setenv("AIOKVTIER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_kernel, "_compile", fake)
    monkeypatch.setattr(_kernel, "_cubins", {})
    return calls


def test_a_second_process_reads_the_kernel_back(
    compiles: list[_kernel.KernelSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _kernel.KernelSpec("sm_90")
    first = _kernel.compile_cubin(spec)
    assert len(compiles) == 1 and _kernel.cubin_path(spec).read_bytes() == first
    monkeypatch.setattr(_kernel, "_cubins", {})  # a new process: nothing compiled in memory
    assert _kernel.compile_cubin(spec) == first
    assert len(compiles) == 1
    other = _kernel.KernelSpec("sm_90", unroll=4)  # another shape is another file
    assert _kernel.compile_cubin(other) != first and len(compiles) == 2
    assert _kernel.cubin_path(other) != _kernel.cubin_path(spec)


def test_a_changed_source_is_never_loaded_stale(
    compiles: list[_kernel.KernelSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _kernel.KernelSpec("sm_90")
    before = _kernel.cubin_path(spec)
    _kernel.compile_cubin(spec)
    monkeypatch.setattr(_kernel, "SOURCE", _kernel.SOURCE + "\n// changed\n")
    monkeypatch.setattr(_kernel, "_cubins", {})
    assert _kernel.cubin_path(spec) != before
    _kernel.compile_cubin(spec)
    assert len(compiles) == 2


def test_a_damaged_file_is_compiled_again(compiles: list[_kernel.KernelSpec], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _kernel.KernelSpec("sm_90")
    _kernel.compile_cubin(spec)
    _kernel.cubin_path(spec).write_bytes(b"not an image")
    monkeypatch.setattr(_kernel, "_cubins", {})
    assert _kernel.compile_cubin(spec)[:4] == b"\x7fELF" and len(compiles) == 2
    # What the driver refused is rebuilt on request, whatever the file holds.
    assert _kernel.compile_cubin(spec, cached=False)[:4] == b"\x7fELF" and len(compiles) == 3


def test_an_unwritable_cache_only_costs_the_compile(
    compiles: list[_kernel.KernelSpec], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    monkeypatch.setenv("AIOKVTIER_CACHE_DIR", str(blocker / "sub"))
    spec = _kernel.KernelSpec("sm_90")
    assert _kernel.compile_cubin(spec)[:4] == b"\x7fELF"
    monkeypatch.setattr(_kernel, "_cubins", {})
    assert _kernel.compile_cubin(spec)[:4] == b"\x7fELF" and len(compiles) == 2


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.tmp"))


def test_a_directory_where_the_file_goes_leaves_no_temporary_file(
    compiles: list[_kernel.KernelSpec], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The replace fails (the name is a directory): each process used to leave its temporary file."""
    spec = _kernel.KernelSpec("sm_90")
    _kernel.cubin_path(spec).mkdir(parents=True)
    for _ in range(3):
        monkeypatch.setattr(_kernel, "_cubins", {})  # a new process each time
        assert _kernel.compile_cubin(spec)[:4] == b"\x7fELF"
    assert len(compiles) == 3 and _temporaries(tmp_path) == []


def test_a_full_disk_leaves_no_temporary_file(
    compiles: list[_kernel.KernelSpec], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = tempfile.mkstemp

    def on_a_full_disk(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real(*args, **kwargs)  # made, as on any disk: the writes are what fail
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(tempfile, "mkstemp", on_a_full_disk)
    spec = _kernel.KernelSpec("sm_90")
    assert _kernel.compile_cubin(spec)[:4] == b"\x7fELF"
    assert _temporaries(tmp_path) == [] and not _kernel.cubin_path(spec).exists()


def test_a_cache_directory_that_is_a_file_only_costs_the_compile(
    compiles: list[_kernel.KernelSpec], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"\x7fELF not a directory")
    monkeypatch.setenv("AIOKVTIER_CACHE_DIR", str(blocker))
    spec = _kernel.KernelSpec("sm_90")
    assert _kernel.compile_cubin(spec)[:4] == b"\x7fELF" and len(compiles) == 1
    assert blocker.read_bytes() == b"\x7fELF not a directory" and _temporaries(tmp_path) == []


def test_no_home_directory_compiles_without_a_cache(
    compiles: list[_kernel.KernelSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container user with no HOME and no passwd entry (and no AIOKVTIER_CACHE_DIR): the kernel
    is compiled and used, kept nowhere (before: ``Path.home()``'s RuntimeError failed the open)."""
    import pwd

    def unknown(uid: int) -> Any:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for name in ("AIOKVTIER_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown)
    spec = _kernel.KernelSpec("sm_90")
    assert _kernel.compile_cubin(spec)[:4] == b"\x7fELF"
    monkeypatch.setattr(_kernel, "_cubins", {})
    assert _kernel.compile_cubin(spec)[:4] == b"\x7fELF" and len(compiles) == 2


def test_threads_of_one_process_compile_once(compiles: list[_kernel.KernelSpec]) -> None:
    spec = _kernel.KernelSpec("sm_90")
    with ThreadPoolExecutor(8) as pool:
        images = list(pool.map(lambda _: _kernel.compile_cubin(spec), range(32)))
    assert len(compiles) == 1 and len(set(images)) == 1


RACER = """
import sys
from aiokvtier._cuda import _kernel

me, rounds = int(sys.argv[1]), int(sys.argv[2])
IMAGE = b"\\x7fELF" + bytes([me]) * 300_000
_kernel._compile = lambda spec, source=None: IMAGE
spec = _kernel.KernelSpec("sm_90")
path = _kernel.cubin_path(spec)
for _ in range(rounds):
    _kernel._cubins.clear()
    _kernel.compile_cubin(spec, cached=False)  # writes its own image over the others'
    _kernel._cubins.clear()
    seen = _kernel.compile_cubin(spec)  # reads whichever image is there
    body = seen[4:]
    assert seen[:4] == b"\\x7fELF" and len(body) == 300_000 and body == body[:1] * 300_000, len(seen)
print("ok")
"""


def test_processes_racing_on_one_cache_file_see_whole_images(tmp_path: Path) -> None:
    """Four processes write and read the same file at once: every read is one writer's whole image."""
    env = {
        **os.environ,
        "AIOKVTIER_CACHE_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(i + 1), "40"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for i in range(4)
    ]
    try:
        outcomes = [racer.communicate(timeout=120) for racer in racers]
    finally:
        for racer in racers:
            racer.kill()
    for racer, (out, err) in zip(racers, outcomes, strict=True):
        assert racer.returncode == 0 and out.strip() == b"ok", err.decode()[-2000:]
    assert _temporaries(tmp_path) == []
