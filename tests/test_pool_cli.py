"""``aiokvtier pool``: serves until SIGTERM (exit 0) or Ctrl-C (SIGINT), refuses in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pool import sock

__all__ = ["sock"]  # the fixture, used by name

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
CLI = [sys.executable, "-m", "aiokvtier", "pool"]
LOW_MEMORY = [sys.executable, str(ROOT / "tests" / "low_memory.py"), str(64 << 20), "pool"]
"""The command where only 64 MiB can be made resident now."""


def _start(
    sock: str, command: list[str] = CLI, quota: str = "64MiB"
) -> tuple[subprocess.Popen[str], dict[str, object]]:
    proc = subprocess.Popen(
        [*command, "--quota", quota, "--max-quota", quota, "--socket", sock],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.communicate(timeout=30)
    return proc, json.loads(line)


_ATTACH = """
import asyncio, sys
from aiokvtier import AttachedPool
async def main():
    async with AttachedPool(sys.argv[1]) as pool:
        print(len(await pool.allocate(3)), (await pool.statistics()).clients)
asyncio.run(main())
"""


def test_serves_until_sigterm_and_exits_0(sock: str) -> None:
    proc, serving = _start(sock)
    try:
        assert serving["event"] == "serving" and serving["path"] == sock and serving["quota"] == 64 << 20
        done = subprocess.run(
            [sys.executable, "-c", _ATTACH, sock], capture_output=True, text=True, env=ENV, timeout=60
        )
        assert done.stdout.split() == ["3", "1"], done.stderr
        second = subprocess.run(
            [*CLI, "--quota", "64MiB", "--socket", sock], capture_output=True, text=True, env=ENV, timeout=60
        )
        assert second.returncode == 1
        assert second.stderr.strip().startswith("aiokvtier: error: PoolError: a pool is already served")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out)["event"] == "stopping" and not err
    assert not os.path.exists(sock)


def test_ctrl_c_closes_it_and_ends_by_sigint(sock: str) -> None:
    """It says it stops as after SIGTERM (the "stopping" line was missing after Ctrl-C)."""
    proc, _ = _start(sock)
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT and not err
    assert json.loads(out)["event"] == "stopping"
    assert not os.path.exists(sock)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quota", "-1GiB"], "argument --quota"),
        (["--quota", "64MiB", "--mode", "8"], "argument --mode"),
        (["--quota", "64MiB", "--socket", "/nonexistent-dir/x.sock"], "argument --socket"),
        ([], "--quota"),
        (["--quota", "1PiB"], "set --max-quota explicitly"),  # the option, where it said the field
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiokvtier: error: ") and message in lines[0]


def test_a_quota_above_the_memory_available_now_is_refused_naming_both_ways_out(sock: str) -> None:
    """Before, only ``demo`` checked: a quota between MemAvailable and MemTotal filled into the OOM killer."""
    done = subprocess.run(
        [*LOW_MEMORY, "--quota", "128MiB", "--socket", sock], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == [
        "aiokvtier: error: argument --quota: 128 MiB is more than this machine can make resident now "
        "(64 MiB available: MemAvailable); the kernel would kill the process part-way: "
        "lower --quota to 64 MiB or less, or pass --force to try anyway"
    ]
    assert not os.path.exists(sock)


def test_force_serves_a_quota_above_the_memory_available_now(sock: str) -> None:
    proc, serving = _start(sock, [*LOW_MEMORY, "--force"], quota="128MiB")
    try:
        assert serving["event"] == "serving" and serving["quota"] == 128 << 20
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out)["event"] == "stopping"


def test_help() -> None:
    done = subprocess.run([*CLI, "--help"], capture_output=True, text=True, env=ENV, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: ") and "--socket" in done.stdout
    # Every option that takes a value says its default (--fill-threads did not), except the required quota.
    options = " ".join(done.stdout.split("options:", 1)[1].split()).split(" --")[1:]
    for option in options:
        name, *words = option.split()
        if words and words[0].isupper() and name != "quota":
            assert "(default: " in option, option
