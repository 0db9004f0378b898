"""How every command and example starts and ends: at once, in one line, with the convention's exit code.

The convention (docs/operations.md): 0 done; 1 a failure while running; 2 a
usage error (a bad value, or something this machine cannot do, refused before
anything runs); Ctrl-C: what is open is closed, then the process ends by
SIGINT (the shell shows 130); a reader that closes stdout: the process ends by
SIGPIPE (the shell shows 141). Never a traceback.
"""

from __future__ import annotations

import ast
import io
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import aiokvtier
from aiokvtier import _program
from aiokvtier._errors import FillError
from aiokvtier._program import UsageError
from aiokvtier._progress import Steps, note

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# -- the package imports nothing heavy until a name is used ---------------------------------------


def test_import_is_light_and_every_name_resolves() -> None:
    code = (
        "import sys, aiokvtier\n"
        "heavy = [m for m in ('numpy', 'pydantic', 'aiokvtier._host._tier') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from aiokvtier import *\n"
        "assert HostTier.__module__ == 'aiokvtier._host._tier'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert done.returncode == 0, done.stderr


# numpy functions that import a numpy submodule on their first call (numpy.ma, numpy.ctypeslib)
LAZY_NUMPY = re.compile(r"\bnp\.(unique|union1d|intersect1d|setdiff1d|setxor1d|isin|in1d|ctypeslib)\b")
USERS_OF_LAZY_NUMPY = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "aiokvtier").rglob("*.py")
    if LAZY_NUMPY.search(path.read_text()) and path.name != "_numpy.py"
)


@pytest.mark.parametrize("module", USERS_OF_LAZY_NUMPY)
def test_a_module_that_calls_numpys_lazy_functions_has_their_submodules_imported(module: str) -> None:
    """np.unique imports numpy.ma on its first call: done then on a loop thread, the import took the
    import lock a thread held (a test's blockbuster caught the loop waiting on it). A module that calls
    such a function has numpy.ma and numpy.ctypeslib imported by the time it is."""
    code = (
        "import sys\n"
        f"import {module}\n"
        "late = [m for m in ('numpy.ma', 'numpy.ctypeslib') if m not in sys.modules]\n"
        "assert not late, late\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    if "ModuleNotFoundError" in done.stderr and module.startswith("aiokvtier.integrations"):
        pytest.skip(f"{module} needs its engine installed: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr


def test_the_lazy_table_matches_all_and_the_type_checkers_imports() -> None:
    tree = ast.parse((ROOT / "aiokvtier" / "__init__.py").read_text())
    checked = {
        (f"{'.' * node.level}{node.module}", alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
        if alias.asname == alias.name
    }
    table = {(module, name) for module, names in aiokvtier._EXPORTS.items() for name in names}
    assert checked == table
    assert sorted(name for _, name in table) == sorted(aiokvtier.__all__)


def test_the_host_package_never_imports_the_cuda_one() -> None:
    """The tier is handed its backings (``aiokvtier._backings``, the one module that knows both): no
    module of ``aiokvtier._host`` imports ``aiokvtier._cuda``, at its top or inside a function."""
    found = []
    for path in sorted((ROOT / "aiokvtier" / "_host").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.name}: {name}" for name in names if "_cuda" in name.split(".")]
    assert found == []


# -- the public errors: named where they are imported from, and pickled whole ---------------------


def _is_exception(name: str) -> bool:
    value = getattr(aiokvtier, name)
    return isinstance(value, type) and issubclass(value, BaseException)


ERRORS = [name for name in aiokvtier.__all__ if _is_exception(name)]
_MADE: dict[str, Callable[[Any], BaseException]] = {  # those whose __init__ takes their fields
    "FillError": lambda cls: cls("fill failed", resident_bytes=4 << 20, failed_offset=8 << 20),
    "DecommitError": lambda cls: cls("a shrink left units committed", committed=((0, 4096), (8192, 4096))),
    "CudaError": lambda cls: cls("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE", 1),
    "BlockNotFound": lambda cls: cls(b"\x00key"),
}


def test_the_public_exceptions_are_the_error_tree() -> None:
    assert sorted(ERRORS) == sorted(aiokvtier._EXPORTS["._errors"])
    assert all(issubclass(getattr(aiokvtier, name), aiokvtier.AiokvtierError) for name in ERRORS)


@pytest.mark.parametrize("name", ERRORS)
def test_a_public_exception_is_named_aiokvtier_and_pickles_whole(name: str) -> None:
    """Tracebacks said ``aiokvtier._errors.PoolError``; FillError, DecommitError and CudaError did not
    unpickle (their __init__ takes their fields), and BlockNotFound came back with its message doubled."""
    cls = getattr(aiokvtier, name)
    assert cls.__module__ == "aiokvtier"
    assert pickle.loads(pickle.dumps(cls)) is cls
    error = _MADE.get(name, lambda cls: cls("why it failed"))(cls)
    error.add_note("a note")
    assert "".join(traceback.format_exception_only(error)).startswith(f"aiokvtier.{name}: ")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(error, protocol))
        assert type(back) is cls and back.args == error.args and str(back) == str(error)
        assert vars(back) == vars(error) and back.__notes__ == ["a note"]


def test_a_pickled_error_comes_back_in_a_fresh_process() -> None:
    """Unpickling imports it from ``aiokvtier``, where nothing of the package was imported yet."""
    error = aiokvtier.FillError("fill failed", resident_bytes=4 << 20, failed_offset=8 << 20)
    code = (
        "import pickle, sys\n"
        "error = pickle.loads(sys.stdin.buffer.read())\n"
        "print(repr(error), type(error).__module__, error.resident_bytes, error.failed_offset)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(error), capture_output=True, env=ENV, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().split() == ["FillError('fill", "failed')", "aiokvtier", str(4 << 20), str(8 << 20)]


# -- every command and example: --help, a bad value, Ctrl-C at any moment, a closed stdout ----------


def _cuda_device() -> bool:
    from aiokvtier import CudaUnavailableError
    from aiokvtier._cuda._driver import device_count

    try:
        return device_count() > 0
    except CudaUnavailableError:
        return False


CUDA = _cuda_device()
CLI = ["-m", "aiokvtier"]
EXAMPLES = {"quickstart.py": [], "engine_mock.py": [], "engine_offload.py": ["--quota", "1GiB"]}


@dataclass(frozen=True)
class Program:
    """A way to run a command or an example, what it prints errors as, and how it ends undisturbed."""

    label: str
    argv: list[str]
    name: str = "aiokvtier"
    status: int = 0
    """The exit status when nothing interrupts it (2: a CUDA mode on a machine without CUDA)."""


RUNS = [
    Program("demo", [*CLI, "demo", "--quota", "1GiB", "--max-quota", "1GiB", "--interval", "0.05", "--hold", "30"]),
    Program("doctor", [*CLI, "doctor"]),
    Program("bench host", [*CLI, "bench", "host", "--quick"]),
    Program("bench store", [*CLI, "bench", "store", "--quick"]),
    Program("bench cuda", [*CLI, "bench", "cuda", "--quick"], status=0 if CUDA else 2),
    Program("bench ranks", [*CLI, "bench", "ranks", "--quick"], status=0 if CUDA else 2),
    Program("python -m aiokvtier.bench", ["-m", "aiokvtier.bench", "store", "--quick", "--sections", "lookup"]),
    *(Program(name, [f"examples/{name}", *args], name=name) for name, args in EXAMPLES.items()),
]

HELP = [
    [*CLI, "--help"],
    *([*CLI, command, "--help"] for command in ("demo", "doctor", "bench")),
    *([*CLI, "bench", mode, "--help"] for mode in ("host", "cuda", "store", "ranks")),
    ["-m", "aiokvtier.bench", "--help"],
    [*CLI, "serve", "--help"],
    ["-m", "aiokvtier.server", "--help"],
    ["-m", "aiokvtier.server.load", "--help"],
    *([f"examples/{name}", "--help"] for name in EXAMPLES),
]

BAD_VALUES = [
    Program("aiokvtier", [*CLI, "--bogus"]),
    Program("demo", [*CLI, "demo", "--quota", "-1GiB"]),
    Program("demo", [*CLI, "demo", "--fill-threads", "0"]),
    Program("doctor", [*CLI, "doctor", "--json", "extra"]),
    Program("bench", [*CLI, "bench", "nope"]),
    Program("bench host", [*CLI, "bench", "host", "--repeats", "-1"]),
    Program("bench cuda", [*CLI, "bench", "cuda", "--full-gib", "0"]),
    Program("bench store", [*CLI, "bench", "store", "--sections", "nope"]),
    Program("bench ranks", [*CLI, "bench", "ranks", "--size-gib", "x"]),
    Program("python -m aiokvtier.bench", ["-m", "aiokvtier.bench", "host", "--gib", "0"]),
    Program("serve", [*CLI, "serve", "--quota", "-1GiB"], name="python -m aiokvtier serve"),
    Program("server", ["-m", "aiokvtier.server", "--port", "70000"], name="python -m aiokvtier.server"),
    Program("load", ["-m", "aiokvtier.server.load", "--bogus"], name="python -m aiokvtier.server.load"),
    *(Program(name, [f"examples/{name}", "--bogus"], name=name) for name in EXAMPLES),
    Program("engine_offload.py", ["examples/engine_offload.py", "--quota", "lots"], name="engine_offload.py"),
]

NOISE = ("Traceback", "Error", "Exception", "failed")
"""Words that only a traceback, an unretrieved task exception or a failed close would print."""


def _popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *argv], text=True, env=ENV, cwd=ROOT, stderr=subprocess.PIPE, **kwargs)


def _each(cases: list[Any], check: Callable[[Any], str | None]) -> None:
    """Run ``check`` on every case, a few at a time (each is a subprocess); fail with every problem found."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [p for p in pool.map(check, cases) if p]
    assert not problems, "\n\n".join(problems)


def test_help_answers_on_stdout_and_exits_0() -> None:
    def check(argv: list[str]) -> str | None:
        proc = _popen(argv, stdout=subprocess.PIPE)
        out, err = proc.communicate(timeout=30)
        if proc.returncode != 0 or not out.startswith("usage: ") or err:
            return f"{argv}: status {proc.returncode}, stderr {err!r}, stdout {out[:200]!r}"
        return None

    _each(HELP, check)


def test_a_bad_value_is_one_line_on_stderr_and_exit_2() -> None:
    def check(program: Program) -> str | None:
        proc = _popen(program.argv, stdout=subprocess.PIPE)
        out, err = proc.communicate(timeout=30)
        lines = err.splitlines()
        if proc.returncode != 2 or out or len(lines) != 1 or not lines[0].startswith(f"{program.name}: error: "):
            return f"{program.argv}: status {proc.returncode}, stderr {err!r}, stdout {out[:200]!r}"
        return None

    _each(BAD_VALUES, check)


def _sigint_caught(pid: int) -> bool | None:
    """Whether the process catches SIGINT now (None: it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


def _until_its_own_code_runs(proc: subprocess.Popen[str], timeout: float = 30) -> None:
    """Python's start-up catches SIGINT (KeyboardInterrupt); a program's first line of ours leaves it to
    the default (end at once). Before that, a Ctrl-C is Python's business, not the program's."""
    deadline = time.monotonic() + timeout
    seen_python = False
    while proc.poll() is None and time.monotonic() < deadline:
        caught = _sigint_caught(proc.pid)
        if caught:
            seen_python = True
        elif seen_python and caught is False:
            return
        time.sleep(0.0005)


DELAYS = [0.0, 0.05, 0.2, 0.6]
"""Seconds after the program's own code starts: its imports, the tier opening, filling, holding or a section."""


@pytest.mark.parametrize("delay", DELAYS)
def test_ctrl_c_at_any_moment_ends_quietly_by_sigint(delay: float) -> None:
    def check(program: Program) -> str | None:
        proc = _popen(program.argv, stdout=subprocess.PIPE)
        try:
            _until_its_own_code_runs(proc)
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            return f"{program.label}, Ctrl-C after {delay} s: still running 30 s later\n{err[-2000:]}"
        expected = {-signal.SIGINT, program.status}
        noise = [line for line in err.splitlines() if any(word in line for word in NOISE)]
        if proc.returncode not in expected or noise:
            return f"{program.label}, Ctrl-C after {delay} s: status {proc.returncode}\n{err[-3000:]}"
        return None

    _each(RUNS, check)


PIPED = [
    # Sections that write their JSON soon, so that the reader is still there or has just left.
    Program("bench host", [*CLI, "bench", "host", "--quick", "--sections", "fill_progress"]),
    Program("bench store", [*CLI, "bench", "store", "--quick", "--sections", "lookup"]),
    *(p for p in RUNS if not p.label.startswith("bench") and not p.label.startswith("python -m")),
    *(p for p in RUNS if p.label in ("bench cuda", "bench ranks") and not CUDA),  # one line, exit 2
]


@pytest.mark.parametrize("when", ["after the first line", "at once"])
def test_a_reader_that_goes_away_ends_it_quietly(when: str) -> None:
    def check(program: Program) -> str | None:
        read, write = os.pipe()
        proc = _popen(program.argv, stdout=write)
        os.close(write)
        with os.fdopen(read) as reader:
            if when == "after the first line":
                reader.readline()
        # The reader is gone: the next write fails with EPIPE (or everything was written already).
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            return f"{program.label}, reader gone {when}: still running 60 s later\n{err[-2000:]}"
        noise = [line for line in err.splitlines() if any(word in line for word in NOISE)]
        if proc.returncode not in {-signal.SIGPIPE, program.status} or noise:
            return f"{program.label}, reader gone {when}: status {proc.returncode}\n{err[-3000:]}"
        return None

    _each(PIPED, check)


@pytest.mark.parametrize("gap", [0.0005, 0.003, 0.02])
def test_a_second_ctrl_c_while_the_tier_closes_ends_it_at_once_and_quietly(gap: float) -> None:
    # The first Ctrl-C cancels the command's task, which closes the tier; a second one lands in that
    # close (or after it) and ends the process: no "closing the HostTier failed: KeyboardInterrupt()".
    def check(program: Program) -> str | None:
        proc = _popen(program.argv, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()  # the tier is open and filling
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        noise = [line for line in err.splitlines() if any(word in line for word in NOISE)]
        if proc.returncode != -signal.SIGINT or noise:
            return f"{program.label}, Ctrl-C twice {gap} s apart: status {proc.returncode}\n{err[-3000:]}"
        return None

    demo = Program("demo", [*CLI, "demo", "--quota", "2GiB", "--max-quota", "2GiB", "--interval", "0.02"])
    _each([demo, Program("engine_mock.py", ["examples/engine_mock.py"], name="engine_mock.py")], check)


# -- progress ------------------------------------------------------------------------------------


def test_plain_progress_lines_say_the_step_the_time_so_far_and_the_time_left() -> None:
    out = io.StringIO()
    with Steps("bench x", ["a", "b", "c"], costs={"a": 1, "b": 1, "c": 2}, out=out, interval=60) as steps:
        steps.begin("a")
        note("repeat 1 of 2")  # within the interval of the step's line: not shown
        steps.begin("b")
        steps.begin("c")
    lines = out.getvalue().splitlines()
    assert lines[0] == "bench x [1/3] a"
    assert re.fullmatch(r"bench x \[2/3\] b \([0-9.]+ s so far, about [0-9.]+ s left\)", lines[1]), lines[1]
    assert lines[2].startswith("bench x [3/3] c (") and re.fullmatch(r"bench x: done in [0-9.]+ s", lines[3])
    assert len(lines) == 4
    note("after the steps: nobody shows it")


def test_notes_show_at_most_once_per_interval() -> None:
    out = io.StringIO()
    with Steps("bench y", ["only"], out=out, interval=0) as steps:
        steps.begin("only")
        note("first")
        note("second")
    assert out.getvalue().splitlines()[1:3] == ["bench y [1/1] only: first", "bench y [1/1] only: second"]


# -- the entry's statuses, in this process ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raised", "status", "line"),
    [
        (None, 0, None),
        (SystemExit(0), 0, None),  # --help, --version
        (UsageError("argument --quota: 'lots' is not a size"), 2, "x: error: argument --quota: 'lots' is not a size"),
        (FillError("making bytes 0.. resident failed", resident_bytes=0, failed_offset=0), 1, "x: error: FillError: "),
        (OSError(12, "Cannot allocate memory"), 1, "x: error: [Errno 12] Cannot allocate memory"),
    ],
)
def test_run_exits_with_the_conventions_status_and_one_line(
    raised: BaseException | None, status: int, line: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    def body() -> int:
        if raised is not None:
            raise raised
        return 0

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as exc:
        _program.run(body, name="x", program=False)
    assert exc.value.code == status
    err = capsys.readouterr().err
    assert (err == "") if line is None else (err.count("\n") == 1 and err.startswith(line))
    assert signal.getsignal(signal.SIGINT) is before  # called in-process: the handler is put back


def test_a_bug_is_not_hidden() -> None:
    with pytest.raises(ZeroDivisionError):
        _program.run(lambda: 1 // 0, program=False)
