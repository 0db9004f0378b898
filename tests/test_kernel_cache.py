"""The SM copy kernel is compiled once per machine: the cubin is kept in the cache directory.

No NVRTC or GPU needed: the compiler is replaced by a counter that returns an ELF image.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aiokvtier._cuda import _kernel


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
