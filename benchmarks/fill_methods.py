"""The first allocation and the loop's lag with the fill copying units in beside the fill touching them.

    python benchmarks/fill_methods.py [--gib 2] [--repeats 2] > OUT.jsonl

The copy fill (``UFFDIO_COPY``, the default on Linux 6.9+) and the touch fill
(what older kernels get) run the bench's own ``time_to_first_allocation`` and
``event_loop_lag_during_fill`` measurements of ``bench host``, arms
interleaved round by round; one JSON line per arm and round. On a kernel
without userfaultfd copies both arms touch (the ``fill_method`` field says).
"""

from __future__ import annotations

import argparse
import json

from aiokvtier._host import _userfault
from aiokvtier.bench import _host

GiB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    size = int(args.gib * GiB)
    supported = _userfault.supported
    try:
        for rep in range(args.repeats):
            for arm in ("copy", "touch"):
                _userfault.supported = supported if arm == "copy" else (lambda: False)  # type: ignore[assignment]
                row = {
                    "arm": arm,
                    "fill_method": "copy" if _userfault.supported() else "touch",
                    "round": rep,
                    "first_allocation": _host.time_to_first_allocation([size], 3),
                    "loop_lag": _host.loop_lag(size),
                }
                print(json.dumps(row), flush=True)
    finally:
        _userfault.supported = supported  # type: ignore[assignment]


if __name__ == "__main__":
    main()
