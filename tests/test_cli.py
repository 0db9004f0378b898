"""The ``aiokvtier`` command as a user meets it, each case in a subprocess where it matters."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from aiokvtier import __version__, _cli, _sysinfo
from aiokvtier._demo import progress_line
from aiokvtier._units import format_bytes, format_rate

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(sys.platform != "linux", reason="uvloop"))]


def _cli_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiokvtier", *args], capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT
    )


# -- the command and its help ---------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    done = _cli_run(flag)
    assert done.returncode == 0 and done.stdout.strip() == f"aiokvtier {__version__}"


def test_serve_is_the_block_servers_command() -> None:
    """``aiokvtier serve`` is ``aiokvtier-server``: its help, and its refusals in one line, exit 2."""
    done = _cli_run("serve", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m aiokvtier serve")
    assert "--grace-seconds" in done.stdout
    done = _cli_run("serve", "--quota", "-1GiB")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "--quota" in done.stderr and "-1GiB" in done.stderr and "Traceback" not in done.stderr
    assert "serve" in _cli_run().stderr  # listed by the bare command


def test_console_script_points_at_main() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["aiokvtier"].partition(":")
    assert getattr(importlib.import_module(module), name) is _cli.main
    exe = shutil.which("aiokvtier")
    if exe is not None:  # installed (pip install -e .): the script runs this checkout's code
        done = subprocess.run([exe, "--version"], capture_output=True, text=True, env=ENV, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == f"aiokvtier {__version__}"


def _actions(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(f"{name} {a.dest}", a) for a in sub._actions if name != "bench"]
        else:
            found.append((action.dest, action))
    return found


def test_every_option_is_described() -> None:
    for name, action in _actions(_cli.build_parser()):
        assert action.help, f"{name} has no help"
    done = _cli_run("bench", "host", "--help")
    assert done.returncode == 0 and "--ops-gib" in done.stdout
    assert "slot operations run on (default: 4; 0.25 with --quick)" in " ".join(done.stdout.split())


def test_help_shows_defaults() -> None:
    done = _cli_run("demo", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for expected in ("(default: 2MiB)", "1 to 256 (default: 1)", "(default: auto)", "(default: asyncio)"):
        assert expected in text
    assert "between progress lines when output is not a terminal (default: 1)" in text
    assert "--quota SIZE" in text and "quarter of the memory available" in text


def test_bench_is_dispatched() -> None:
    done = _cli_run("bench", "--help")
    assert done.returncode == 0 and "host" in done.stdout and "store" in done.stdout
    assert done.stdout.startswith("usage: python -m aiokvtier bench")


@pytest.mark.parametrize("args", [[], ["bench"]], ids=["aiokvtier", "bench"])
def test_no_command_prints_usage_and_the_commands_and_exits_2(args: list[str]) -> None:
    done = _cli_run(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: python -m aiokvtier")
    commands = ["demo", "doctor", "pool", "bench", "serve"] if not args else ["host", "cuda", "store", "ranks"]
    listed = [line.split()[0] for line in done.stderr.splitlines() if line[:4] == "    " and line[4] != " "]
    assert listed == commands


# -- bad values: one line naming the option, exit 2 -----------------------------------------------


@pytest.mark.parametrize(
    ("args", "option", "says"),
    [
        (["--quota", "lots"], "--quota", "not a size"),
        (["--quota", "0"], "--quota", "more than 0 bytes"),
        (["--quota", "-5GiB"], "--quota", "'-5GiB' is negative: a size is more than 0 bytes"),
        (["--quota=-5GiB"], "--quota", "negative"),
        (["--quota", "1.5x"], "--quota", "unknown unit"),
        (["--slot-size", "5000"], "--slot-size", "multiple of the 4096-byte page"),
        (["--quota", "1MiB", "--slot-size", "2MiB"], "--quota", "zero slots"),
        (["--quota", "64MiB", "--max-quota", "32MiB"], "--max-quota", "below quota"),
        (["--fill-threads", "0"], "--fill-threads", "'0' is not 1 to 256"),
        (["--fill-threads", "257"], "--fill-threads", "'257' is not 1 to 256"),
        (["--fill-threads", "many"], "--fill-threads", "not a whole number"),
        (["--device", "-1"], "--device", "'-1' is not 0 or more"),
        (["--numa-node", "x"], "--numa-node", ""),
        (["--numa-node", "4095"], "--numa-node", "not an online node"),
        (["--backing", "vmm"], "--backing", "needs a CUDA device: set --device"),  # the option, not the field
        (["--quota", "64MiB", "--max-quota", "32MiB"], "--max-quota", "raise --max-quota or lower --quota"),
        (["--interval", "0"], "--interval", "positive"),
        (["--hold", "-1"], "--hold", "0 or more seconds"),
        (["--hold", "nan"], "--hold", "0 or more seconds"),
        (["--hold", "soon"], "--hold", "not a number of seconds"),
        (["--quota", "100TiB"], "--quota", "--force"),
    ],
)
def test_bad_option_values_print_one_line(args: list[str], option: str, says: str) -> None:
    done = _cli_run("demo", *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"aiokvtier: error: argument {option}: ") and says in lines[0], lines[0]
    assert "Input should" not in lines[0]  # pydantic's words, not ours
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("args", "option", "says"),
    [
        (["host", "--ops-gib", "0"], "--ops-gib", "at least 2 MiB"),
        (["host", "--ops-gib", "0.00001"], "--ops-gib", "at least 2 MiB"),
        (["host", "--fill-gib", "-1"], "--fill-gib", "at least 2 MiB"),
        (["host", "--sizes", "4", "nan"], "--sizes", "at least 2 MiB"),
        (["host", "--pairs", "0"], "--pairs", "1 or more"),
        (["host", "--repeats", "0"], "--repeats", "1 or more"),
        (["host", "--repeats", "x"], "--repeats", "not a whole number"),
        (["host", "--repeats", "-2"], "--repeats", "1 or more"),
        (["host", "--settle", "-1"], "--settle", "0 or more seconds"),
        (["host", "--cold-threads", "0"], "--cold-threads", "1 to 256"),
        (["host", "--register-units-mib", "0"], "--register-units-mib", "positive"),
        (["host", "--sections", "ops"], "--sections", "choose from time_to_first_allocation"),
        (["store", "--repeats", "0"], "--repeats", "1 or more"),
        (["store", "--sections", "nope"], "--sections", "choose from lookup"),
        # Before: every other section ran, then the tiers section failed with ENOENT and exit 1.
        (["store", "--disk-path", "/nonexistent-dir"], "--disk-path", "/nonexistent-dir is not a directory"),
        (["cuda", "--full-gib", "0"], "--full-gib", "at least 2 MiB"),
        # The names before the device: without a GPU it said there was no CUDA device.
        (
            ["cuda", "--sections", "nope"],
            "--sections",
            "unknown sections ['nope']; choose from time_to_first_allocation",
        ),
        (["cuda", "--sections", "cold", "nope"], "--sections", "unknown sections ['nope']; choose from"),
        (["ranks", "--size-gib", "0"], "--size-gib", "at least 2 MiB"),
    ],
)
def test_bad_bench_option_values_print_one_line(args: list[str], option: str, says: str) -> None:
    # Before, these crashed part way (StatisticsError, ZeroDivisionError, EINVAL from munmap, a pydantic
    # traceback) or exited 1; now they are refused before anything runs.
    done = _cli_run("bench", *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"aiokvtier: error: argument {option}: ") and says in lines[0], lines[0]
    assert done.stdout == ""


def test_small_bench_sizes_round_to_whole_2_mib_and_print_json() -> None:
    # --fill-gib 0.01 is 10737418.24 bytes: not a page multiple, which munmap refused (EINVAL).
    done = _cli_run(
        "bench", "host", "--sections", "fill_throughput", "time_to_first_allocation", "slot_operations",
        "--fill-gib", "0.01", "--sizes", "0.01", "--ops-gib", "0.01", "--pairs", "100", "--repeats", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["time_to_first_allocation"][0]["quota_gib"] == 5 * 2 / 1024  # 10 MiB
    assert report["fill_throughput"] and report["slot_operations"]


def test_quota_above_available_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sysinfo, "available_memory", lambda: (64 << 20, "MemAvailable"))
    with pytest.raises(SystemExit) as exc:
        _cli.main(["demo", "--quota", "128MiB"])
    assert exc.value.code == 2


def test_force_opens_past_the_memory_available(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_sysinfo, "available_memory", lambda: (64 << 20, "MemAvailable"))
    with pytest.raises(SystemExit) as exc:
        _cli.main(["demo", "--quota", "128MiB", "--force", "--json", "--interval", "0.05"])
    assert exc.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quota_bytes"] == 128 << 20


def test_default_quota_stays_inside_an_explicit_max_quota() -> None:
    done = _cli_run("demo", "--max-quota", "64MiB", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["quota_bytes"] == report["max_quota_bytes"] == 64 << 20


def test_default_quota_is_a_quarter_of_available_in_whole_gib() -> None:
    gib = 1 << 30
    assert _cli._default_quota(int(22.5 * gib)) == 5 * gib
    assert _cli._default_quota(200 * gib) == 8 * gib
    assert _cli._default_quota(gib) == gib


# -- what the demo shows and reports --------------------------------------------------------------


def test_units() -> None:
    assert format_bytes(998244352) == "952 MiB" and format_bytes(1 << 30) == "1 GiB"
    assert format_bytes(int(1.5 * (1 << 30))) == "1.50 GiB" and format_bytes(512) == "512 bytes"
    assert format_rate(1 << 30) == "1 GiB/s" and format_rate(1.2 * (1 << 30)) == "1.20 GiB/s"


def test_progress_line_rate_is_bytes_per_second() -> None:
    # ~1 GiB/s must read as GiB/s, not kB/s.
    assert progress_line(1 << 30, 4 << 30, 1.0) == "fill: 1 GiB of 4 GiB (25%), 1 GiB/s, 1.0 s"
    assert progress_line(0, 0, 0.0).startswith("fill: 0 bytes of 0 bytes (100%), 0 bytes/s")


@pytest.mark.parametrize("loop", LOOPS)
def test_demo_reports_what_the_tier_holds(loop: str) -> None:
    done = _cli_run("demo", "--quota", "1GB", "--max-quota", "2GiB", "--json", "--loop", loop)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # --json: stdout is the report alone
    assert report["quota_requested"] == "1GB"
    assert report["slots_total"] == 10**9 // (2 << 20) == 476
    assert report["quota_bytes"] == 476 * (2 << 20)
    assert report["resident_bytes"] >= report["quota_bytes"]
    assert report["resident_bytes"] % report["commit_unit_bytes"] == 0
    assert report["fill_gib_per_s"] > 0 and report["time_to_first_allocation_ms"] > 0
    assert "quota 952 MiB = 476 slots of 2 MiB (asked for 1GB)" in done.stderr


def test_demo_prints_plain_progress_lines_off_a_terminal() -> None:
    done = _cli_run("demo", "--quota", "1GiB", "--max-quota", "1GiB", "--interval", "0.05")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("fill: ")]
    assert lines and lines[-1].startswith("fill: 1 GiB of 1 GiB (100%), ")
    for line in lines:
        assert "/s, " in line and "kB/s" not in line
    assert "\x1b[" not in done.stdout  # no terminal control codes in a pipe
    assert json.loads(done.stdout[done.stdout.index("{") :])["resident_bytes"] == 1 << 30


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("when", ["filling", "holding"])
def test_ctrl_c_closes_the_tier_and_ends_by_sigint(loop: str, when: str) -> None:
    args = ["demo", "--quota", "2GiB", "--max-quota", "2GiB", "--interval", "0.02", "--hold", "60", "--loop", loop]
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiokvtier", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, "PYTHONFAULTHANDLER": "1"},  # SIGABRT prints every thread's stack
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        wanted = "fill: " if when == "filling" else "holding the tier open"
        for line in proc.stdout:
            if line.startswith(wanted):
                break
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # still running a minute after Ctrl-C: where is it?
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"the demo ignored Ctrl-C for 60 s; its threads:\n{err[-8000:]}\nits output:\n{out[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGINT, err  # a shell shows 130
    assert err == "", err  # no traceback, no "Task exception was never retrieved"
    assert "{" not in out  # interrupted: no report


def _cuda_bindings() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_cuda_bindings(), reason="cuda-bindings is installed: the device may exist")
def test_a_device_without_cuda_is_a_usage_error_in_one_line() -> None:
    # Found before the tier opens, as a quota above the memory available is: exit 2, as for a bad value.
    done = _cli_run("demo", "--quota", "64MiB", "--max-quota", "64MiB", "--device", "0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiokvtier: error: argument --device: ")
    assert "cuda-bindings is not installed" in lines[0]


@pytest.mark.cuda
def test_demo_on_a_gpu_picks_register() -> None:
    done = _cli_run("demo", "--quota", "256MiB", "--max-quota", "256MiB", "--device", "0", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["backing"] == "register" and report["device"] == 0
    assert report["resident_bytes"] >= report["quota_bytes"] == 256 << 20
