"""``bench store --sections shared`` runs here and prints its figures as JSON (times are not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_the_shared_section_prints_its_figures() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aiokvtier.bench", "store", "--quick", "--sections", "shared"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    shared = json.loads(done.stdout)["shared"]
    during, cross = shared["attach_during_fill"], shared["cross_process"]
    assert {"attach_ms", "first_slot_ms", "first_lookup_ms", "resident_fraction_at_first_slot"} <= set(during)
    assert cross["bit_exact"] is True and cross["blocks"] == 512
    assert {"lookup_ms_in_b", "load_gb_s_in_a", "load_gb_s_in_b", "b_over_a"} <= set(cross)
    concurrent = shared["concurrent"]
    assert concurrent["processes"] == 8 and concurrent["lookup_ms"]["n"] == concurrent["store_ms"]["n"] == 160
    assert concurrent["lookup_cpu_ms"]["n"] == 160
    eight = shared["eight_processes"]
    assert eight["processes"] == 8 and eight["same_bytes_read"] is True
    assert len(eight["shared_bytes_mapped_per_process"]) == 8
