"""The base install imports no engine: ``aiokvtier`` and ``aiokvtier.integrations`` leave vLLM and torch alone."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import aiokvtier
import aiokvtier.integrations
aiokvtier.HostTier, aiokvtier.BlockStore, aiokvtier.CopyEngine  # the lazily imported core too
heavy = sorted(name for name in ("vllm", "torch", "sglang", "lmcache") if name in sys.modules)
print(",".join(heavy))
"""


def test_the_base_package_and_the_integrations_package_import_no_engine() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "", f"imported: {done.stdout.strip()}"
