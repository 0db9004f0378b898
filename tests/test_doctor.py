"""``aiokvtier doctor``: each check on this machine, the parsers on made-up sysfs trees, the JSON shape."""

from __future__ import annotations

import errno
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from aiokvtier import _doctor, _sysinfo
from aiokvtier._config import default_max_quota

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
VERDICTS = {"ok", "info", "warn", "fail", "skip"}


def _well_formed(check: _doctor.Check) -> None:
    assert check.verdict in VERDICTS
    assert check.summary and "\n" not in check.summary and "\n" not in check.advice
    json.dumps(check.data)  # every figure is JSON


# -- each check on this machine -------------------------------------------------------------------


def test_platform_is_linux() -> None:
    check = _doctor.check_platform()
    _well_formed(check)
    assert check.verdict == "ok" and check.data["release"] == platform.release()


def test_memory_reports_the_max_quota_default_the_config_uses() -> None:
    check = _doctor.check_memory()
    _well_formed(check)
    assert check.verdict in ("ok", "info")
    assert check.data["default_max_quota_bytes"] == default_max_quota()
    assert 0 < check.data["available_bytes"] <= check.data["mem_total_bytes"]
    assert check.data["cgroup_limit_bytes"] == _sysinfo.cgroup_memory_limit()


def test_virtualization() -> None:
    check = _doctor.check_virtualization()
    _well_formed(check)
    assert check.verdict in ("ok", "info") and isinstance(check.data["virtual"], bool)


def test_populate_is_tried_on_a_scratch_mapping() -> None:
    before = Path("/proc/self/maps").read_text().count("\n")
    check = _doctor.check_populate()
    _well_formed(check)
    assert check.verdict in ("ok", "warn")
    assert check.data["supported"] is (check.verdict == "ok")
    assert Path("/proc/self/maps").read_text().count("\n") == before  # the scratch mapping is gone


def test_the_copy_fill_is_tried_on_a_scratch_range(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokvtier._host import _userfault

    if _userfault.supported():
        _userfault._zeros()  # the process's zero source, mapped once and kept, is no leak
    before = Path("/proc/self/maps").read_text().count("\n")
    check = _doctor.check_copy_fill()
    _well_formed(check)
    assert check.data["supported"] is (check.verdict == "ok")
    assert check.data["supported"] is _userfault.supported() or check.verdict == "warn"
    assert Path("/proc/self/maps").read_text().count("\n") == before  # the scratch range is gone
    monkeypatch.setattr(_userfault, "supported", lambda: False)
    assert _doctor.check_copy_fill().data == {"supported": False, "reason": "kernel"}


def test_a_refused_userfaultfd_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokvtier._host import _userfault

    class Refused:
        """What the kernel's refusal looks like to the doctor: the userfaultfd cannot be made."""

        def __init__(self, addr: int, length: int) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(_userfault, "supported", lambda: True)
    monkeypatch.setattr(_userfault, "Userfault", Refused)
    check = _doctor.check_copy_fill()
    assert check.verdict == "warn" and "seccomp" in check.advice and check.data["errno"] == errno.EPERM


def test_mbind_is_tried_on_a_scratch_mapping() -> None:
    check = _doctor.check_mbind()
    _well_formed(check)
    if _sysinfo.online_nodes():
        assert check.verdict in ("ok", "warn")
        assert check.data["permitted"] is (check.verdict == "ok")
        assert check.data["node"] == min(_sysinfo.online_nodes() or {0})
    else:
        assert check.verdict == "skip"


def test_thp_reads_the_selected_modes() -> None:
    check = _doctor.check_thp()
    _well_formed(check)
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if enabled.exists():
        assert f"[{check.data['enabled']}]" in enabled.read_text()
        assert check.summary.startswith(f"enabled={check.data['enabled']} defrag=")


def test_numa_has_one_check_per_online_node() -> None:
    checks = _doctor.check_numa()
    for check in checks:
        _well_formed(check)
    nodes = _sysinfo.online_nodes()
    if nodes is None:
        assert [c.verdict for c in checks] == ["skip"]
        return
    assert [c.data["node"] for c in checks] == sorted(nodes)
    for check in checks:
        assert set(check.data["cpus"]) == _sysinfo.node_cpus(check.data["node"])
        assert check.data["mem_total_bytes"] > 0 and check.data["free_huge_blocks"] >= 0


def test_memlock_matches_getrlimit() -> None:
    check = _doctor.check_memlock()
    _well_formed(check)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert check.data["soft"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert check.verdict == ("ok" if soft == resource.RLIM_INFINITY else "info")


def test_cuda_skips_cleanly_without_a_device() -> None:
    checks = _doctor.check_cuda()
    for check in checks:
        _well_formed(check)
    if checks[0].verdict == "skip":
        assert len(checks) == 1


@pytest.mark.cuda
def test_cuda_lists_every_gpu_with_bus_id_node_and_auto_backing() -> None:
    from aiokvtier._cuda import _driver

    checks = _doctor.check_cuda()
    assert checks[0].name == "cuda" and checks[0].data["driver_api"] > 0
    gpus = [c for c in checks if c.name.startswith("gpu")]
    assert len(gpus) == _driver.device_count()
    for i, gpu in enumerate(gpus):
        assert gpu.data["device"] == i and gpu.data["auto_backing"] == "register"
        assert gpu.data["bus_id"].count(":") == 2
        assert gpu.data["numa_node"] == _driver.device_numa_node(i)


def test_run_checks_orders_every_check_and_none_is_fatal_here() -> None:
    checks = _doctor.run_checks(cuda=False)
    names = [c.name for c in checks]
    assert names[:6] == ["platform", "memory", "vm", "populate", "copy-fill", "mbind"]
    assert {"thp", "memlock", "cuda"} <= set(names)
    assert not any(c.fatal for c in checks)


def test_a_probe_that_raises_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def check_broken() -> _doctor.Check:
        raise RuntimeError("boom")

    monkeypatch.setattr(_doctor, "_CHECKS", (_doctor.check_platform, check_broken))
    checks = _doctor.run_checks()
    assert [(c.name, c.verdict) for c in checks] == [("platform", "ok"), ("broken", "warn")]
    assert "RuntimeError: boom" in checks[1].summary


# -- parsers on made-up files ---------------------------------------------------------------------

BUDDYINFO = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone   Normal    457   1049   1741   1858    972    655    659    441    216     75    957
Node 1, zone   Normal      1      1      1      1      1      1      1      1      1      0      0
"""


def test_free_blocks_counts_order_9_and_up_in_order_9_units() -> None:
    assert _doctor.free_blocks(BUDDYINFO, 9) == {0: (1 + 3 * 2) + (75 + 957 * 2), 1: 0}
    assert _doctor.free_blocks(BUDDYINFO, 10) == {0: 3 + 957, 1: 0}


@pytest.mark.parametrize(
    ("enabled", "defrag", "verdict"),
    [
        ("always [madvise] never", "always defer defer+madvise [madvise] never", "ok"),
        ("[always] madvise never", "[always] defer defer+madvise madvise never", "warn"),
        ("always madvise [never]", "always defer defer+madvise [madvise] never", "info"),
        ("always [madvise] never", "always [defer] defer+madvise madvise never", "ok"),
    ],
)
def test_thp_verdicts(tmp_path: Path, enabled: str, defrag: str, verdict: str) -> None:
    (tmp_path / "enabled").write_text(enabled + "\n")
    (tmp_path / "defrag").write_text(defrag + "\n")
    check = _doctor.check_thp(tmp_path)
    assert check.verdict == verdict
    assert check.data == {"enabled": enabled.split("[")[1].split("]")[0], "defrag": defrag.split("[")[1].split("]")[0]}


def test_thp_missing_is_a_skip(tmp_path: Path) -> None:
    assert _doctor.check_thp(tmp_path).verdict == "skip"


def _node(root: Path, node: int, cpus: str, total_kb: int, free_kb: int) -> None:
    here = root / f"node{node}"
    here.mkdir(parents=True)
    (here / "cpulist").write_text(cpus + "\n")
    (here / "meminfo").write_text(
        f"Node {node} MemTotal:       {total_kb} kB\nNode {node} MemFree:        {free_kb} kB\n"
        f"Node {node} HugePages_Total:     0\n"
    )


def test_numa_nodes_memory_only_and_fragmented(tmp_path: Path) -> None:
    (tmp_path / "online").write_text("0-2\n")
    _node(tmp_path, 0, "0-3,8", 64 << 20, 32 << 20)  # 32 GiB free, ~1.9 GiB of it in huge blocks: fragmented
    _node(tmp_path, 1, "4-7", 64 << 20, 32 << 20)  # plenty of huge blocks
    _node(tmp_path, 2, "", 16 << 20, 16 << 20)  # memory only (CXL, HBM)
    buddy = tmp_path / "buddyinfo"
    buddy.write_text(
        "Node 0, zone Normal 0 0 0 0 0 0 0 0 0 960 0\n"
        "Node 1, zone Normal 0 0 0 0 0 0 0 0 0 0 8000\n"
        "Node 2, zone Normal 0 0 0 0 0 0 0 0 0 0 4000\n"
    )
    checks = _doctor.check_numa(tmp_path, buddy)
    assert [(c.name, c.verdict) for c in checks] == [("numa0", "warn"), ("numa1", "ok"), ("numa2", "info")]
    assert checks[0].data["cpus"] == [0, 1, 2, 3, 8] and "5 CPUs (0-3,8)" in checks[0].summary
    assert checks[0].data["mem_free_bytes"] == 32 << 30
    if checks[1].data["huge_block_bytes"] == 2 << 20:  # order 9 on 4 KiB pages
        assert checks[1].data["free_huge_blocks"] == 16000 and checks[0].data["free_huge_blocks"] == 960
    assert "fragmented" in checks[0].advice and "memory only" in checks[2].summary


def test_numa_without_sysfs_is_a_skip(tmp_path: Path) -> None:
    assert [c.verdict for c in _doctor.check_numa(tmp_path / "none", tmp_path / "none")] == ["skip"]


def test_meminfo_reads_host_and_node_files(tmp_path: Path) -> None:
    host = tmp_path / "meminfo"
    host.write_text("MemTotal:       24576000 kB\nMemAvailable:   1000 kB\nHugePages_Total:       4\n")
    assert _sysinfo.meminfo(host) == {"MemTotal": 24576000 * 1024, "MemAvailable": 1024000, "HugePages_Total": 4}
    node = tmp_path / "node"
    node.write_text("Node 0 MemTotal:       1024 kB\nNode 0 MemFree:        512 kB\n")
    assert _sysinfo.meminfo(node) == {"MemTotal": 1 << 20, "MemFree": 512 << 10}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_tightest_limit_on_the_way_up(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/app.service\n")
    root = tmp_path / "fs"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "system.slice" / "memory.max", str(8 << 30))
    _write(root / "system.slice" / "memory.current", str(3 << 30))
    _write(root / "system.slice" / "memory.stat", f"anon 1\ninactive_file {1 << 30}\n")
    _write(root / "system.slice" / "app.service" / "memory.max", "max\n")
    got = _sysinfo.cgroup_memory(proc, root)
    assert got == _sysinfo.CgroupMemory("v2", 8 << 30, 2 << 30)


def test_cgroup_v1_reads_the_process_cgroup_not_only_the_root(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/\n4:memory:/kubepods/pod1\n0::/\n")
    root = tmp_path / "fs"
    unlimited = "9223372036854771712\n"
    _write(root / "memory" / "memory.limit_in_bytes", unlimited)
    _write(root / "memory" / "kubepods" / "memory.limit_in_bytes", unlimited)
    _write(root / "memory" / "kubepods" / "pod1" / "memory.limit_in_bytes", str(4 << 30))
    _write(root / "memory" / "kubepods" / "pod1" / "memory.usage_in_bytes", str(1 << 30))
    assert _sysinfo.cgroup_memory(proc, root) == _sysinfo.CgroupMemory("v1", 4 << 30, 1 << 30)


def test_cgroup_v1_in_a_container_without_a_cgroup_namespace(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path, but the container's own cgroup is mounted at the root.
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/0123abcd\n")
    root = tmp_path / "fs"
    _write(root / "memory" / "memory.limit_in_bytes", str(2 << 30))
    assert _sysinfo.cgroup_memory(proc, root).limit == 2 << 30


def test_no_cgroup_at_all(tmp_path: Path) -> None:
    assert _sysinfo.cgroup_memory(tmp_path / "none", tmp_path) == _sysinfo.CgroupMemory(None, None, None)


# -- the command ----------------------------------------------------------------------------------


def _doctor_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiokvtier", "doctor", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        cwd=ROOT,
    )


def test_doctor_json_shape() -> None:
    done = _doctor_cmd("--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == {"aiokvtier", "fatal", "checks"} and report["fatal"] is False
    from aiokvtier import __version__

    assert report["aiokvtier"] == __version__
    for check in report["checks"]:
        assert set(check) == {"name", "verdict", "summary", "advice", "data"}
        assert check["verdict"] in VERDICTS and isinstance(check["data"], dict)
    names = [c["name"] for c in report["checks"]]
    assert len(names) == len(set(names))
    assert {"platform", "memory", "populate", "mbind", "thp", "memlock", "cuda"} <= set(names)


def test_doctor_prints_one_line_per_check() -> None:
    done = _doctor_cmd("--no-cuda")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(_doctor.run_checks(cuda=False))
    for line in lines:
        assert line.split()[0] in {v.upper() for v in VERDICTS}
    assert any(line.split()[1] == "populate" for line in lines)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--mooncake-master", "foo"], "argument --mooncake-master: 'foo' is not HOST:PORT (e.g. 127.0.0.1:50051)"),
        (["--mooncake-master", "host:"], "argument --mooncake-master: 'host:' is not HOST:PORT (e.g. 127.0.0.1:50051)"),
        (
            ["--mooncake-master", ":50051"],
            "argument --mooncake-master: ':50051' is not HOST:PORT (e.g. 127.0.0.1:50051)",
        ),
        (
            ["--mooncake-master", "host:99999"],
            "argument --mooncake-master: 'host:99999' is not HOST:PORT (e.g. 127.0.0.1:50051)",
        ),
        (["--disk-path"], "argument --disk-path: expected one argument"),
    ],
)
def test_doctor_refuses_a_bad_option_in_one_line(args: list[str], says: str) -> None:
    """A master address without a port was taken, and the check said only that it did not answer."""
    done = _doctor_cmd(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"aiokvtier: error: {says}"]


def test_format_line() -> None:
    check = _doctor.Check("thp", "warn", "enabled=always defrag=always", "do this")
    assert _doctor.format_line(check) == "WARN  thp         enabled=always defrag=always  -> do this"
    assert _doctor.format_line(_doctor.Check("vm", "ok", "bare")) == "OK    vm          bare"


def test_a_fatal_check_makes_the_command_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiokvtier import _cli

    def check_fatal() -> _doctor.Check:
        return _doctor.Check("scratch", "fail", "no mapping", "check ulimit -v")

    monkeypatch.setattr(_doctor, "_CHECKS", (_doctor.check_platform, check_fatal))
    with pytest.raises(SystemExit) as exc:
        _cli.main(["doctor", "--json"])
    assert exc.value.code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["fatal"] is True and [c["verdict"] for c in report["checks"]] == ["ok", "fail"]


def test_disk_check_says_where_the_tier_would_go_and_how(tmp_path: Path) -> None:
    ok = _doctor.check_disk(tmp_path)
    assert ok.verdict in ("ok", "warn") and ok.data["path"] == str(tmp_path)
    assert ok.data["file_system"] != "unknown" and ok.data["free_bytes"] > 0
    assert isinstance(ok.data["direct_io"], bool)
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
    file = tmp_path / "file"
    file.write_bytes(b"")
    assert _doctor.check_disk(file).verdict == "fail"
    assert "not a directory" in _doctor.check_disk(tmp_path / "missing").summary
    checks = _doctor.run_checks(cuda=False, disk_path=tmp_path)
    assert checks[-1].name == "disk"
    assert all(c.name != "disk" for c in _doctor.run_checks(cuda=False))


def test_disk_check_warns_of_a_tier_in_memory() -> None:
    shm = Path("/dev/shm")
    check = _doctor.check_disk(shm) if shm.is_dir() else None
    if check is None or check.data.get("file_system") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    assert check.verdict == "warn" and "memory, not disk" in check.advice


@pytest.mark.parametrize(
    ("why", "summary", "advice"),
    [
        (
            "the Mooncake Store client is not installed: pip install 'aiokvtier[mooncake]'",
            "the Mooncake Store client is not installed",
            "for a Mooncake tier: pip install 'aiokvtier[mooncake]'",
        ),
        (
            "the mooncake wheel is installed but cannot load (install libibverbs: ...): ...",
            "the mooncake wheel is installed but cannot load (install libibverbs: ...): ...",
            "install what it names, then run 'aiokvtier doctor' again",
        ),
    ],
)
def test_the_mooncake_check_advises_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, why: str, summary: str, advice: str
) -> None:
    """A wheel that is installed but cannot load its libraries was told to pip install the wheel."""
    from aiokvtier._mooncake import _client

    monkeypatch.setattr(_client, "why_unloadable", lambda: why)
    check = _doctor.check_mooncake(None)
    assert check.verdict == "skip" and check.summary == summary and check.advice == advice


def test_the_mooncake_line_names_the_install_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The summary said the pip command and the advice said it again, on one line."""
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # the wheel is not installed: the import fails
    line = _doctor.format_line(_doctor.check_mooncake(None))
    assert line.count("pip install 'aiokvtier[mooncake]'") == 1, line
    assert line.startswith("SKIP  mooncake    the Mooncake Store client is not installed  -> "), line
