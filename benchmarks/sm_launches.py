"""How a request's slices are launched on the SM copy path: slice size, streams, programmatic launch.

    python benchmarks/sm_launches.py [--repeats 2] [--configs alt4 alt4_pdl one4_pdl one8_pdl alt8_pdl] > OUT.jsonl

Each configuration sets ``_sm.SLICE_BYTES``, ``_sm.ALTERNATE`` (slices alternating between the
copy's stream and a partner stream, half the budget each) and ``_sm.PDL`` (each slice a
programmatic dependent of the one before it on its stream), then runs the bench's own
measurements (``aiokvtier.bench._sm``) at the default budget of 4 SMs: the kernel's upload and
launches as the engine queues them, device-timed, over 128 MiB of shuffled 4, 16 and 64 KiB
pages (with the 16-program anchor gather of the same run), and a bf16 matmul loop's slowdown
beside 4 and 16 KiB requests, with the copy engines in the same run. Configurations are
interleaved round by round; one JSON line per configuration and round. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json

from aiokvtier._cuda import _sm as sm
from aiokvtier.bench import _sm

MiB = 1 << 20
CONFIGS = {  # name: (alternate, pdl, slice MiB)
    "one4": (False, False, 4),
    "alt4": (True, False, 4),
    "alt4_pdl": (True, True, 4),
    "one4_pdl": (False, True, 4),
    "one8_pdl": (False, True, 8),
    "alt8_pdl": (True, True, 8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=sorted(CONFIGS),
        default=["alt4", "alt4_pdl", "one4_pdl", "one8_pdl", "alt8_pdl"],
    )
    args = parser.parse_args()
    _sm.ARMS = ()
    _sm.KERNEL_BUDGETS = (4,)
    _sm.PAGES = (4 << 10, 16 << 10, 64 << 10)
    _sm.MATMUL_ARMS = (("sm4", {"method": "sm", "sm_budget": 4}, None), ("dma", {"method": "dma"}, None))
    for rep in range(args.repeats):
        for name in args.configs:
            sm.ALTERNATE, sm.PDL, mib = CONFIGS[name]
            sm.SLICE_BYTES = mib * MiB
            bw = _sm.copy_bandwidth_sm(128 * MiB)
            mm = _sm.concurrent_compute(128 * MiB)
            shuffled = {k: v for k, v in bw.items() if k.startswith("shuffled")}
            print(json.dumps({"config": name, "rep": rep, "bw": shuffled, "mm": mm}), flush=True)


if __name__ == "__main__":
    main()
