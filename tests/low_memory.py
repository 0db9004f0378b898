"""The ``aiokvtier`` command on a machine that can make only BYTES resident now:
``python tests/low_memory.py BYTES COMMAND [OPTION...]`` replaces ``_sysinfo.available_memory`` (what
``MemAvailable`` and the memory cgroup's room say) and runs the command, exiting as it does."""

from __future__ import annotations

import sys

from aiokvtier import _cli, _sysinfo

if __name__ == "__main__":
    available = int(sys.argv[1])
    _sysinfo.available_memory = lambda: (available, "MemAvailable")
    _cli.main(sys.argv[2:])
