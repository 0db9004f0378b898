"""How a request's slices are launched on the SM copy path: slice size, streams, programmatic launch,
descriptor size.

    python benchmarks/sm_launches.py [--repeats 2] [--configs one8_pdl one8_pdl_pack_bound ...] > OUT.jsonl

Each configuration is an ``SmOptions``: ``slice_bytes``, ``alternate`` (slices alternating between
the copy's stream and a partner stream, half the budget each), ``pdl`` (each slice a
programmatic dependent of the one before it on its stream), ``pack`` (8-byte descriptors
for requests of one page size, instead of 24), ``bounded`` (a slice's successor starts
only once the slice before it has ended) and ``head``, with which it runs the bench's own
measurements (``aiokvtier.bench._sm``) at the default budget of 4 SMs: the kernel's upload and
launches as the engine queues them, device-timed, over 128 MiB of shuffled 4, 16 and 64 KiB
pages (with the 16-program anchor gather of the same run), and a bf16 matmul loop's slowdown
beside 4 and 16 KiB requests, with the copy engines in the same run. Configurations are
interleaved round by round; one JSON line per configuration and round. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json

from aiokvtier import SmOptions
from aiokvtier.bench import _sm

MiB = 1 << 20
CONFIGS = {  # name: (alternate, pdl, slice MiB, pack, bounded[, head]); without pack, bound or head: off
    "one4": (False, False, 4, False, False),
    "alt4": (True, False, 4, False, False),
    "alt4_pdl": (True, True, 4, False, False),
    "one4_pdl": (False, True, 4, False, False),
    "one8_pdl": (False, True, 8, False, False),
    "alt8_pdl": (True, True, 8, False, False),
    "one8_pdl_pack": (False, True, 8, True, False),
    "one8_pdl_bound": (False, True, 8, False, True),
    "one8_pdl_pack_bound": (False, True, 8, True, True),
    "one16_pdl_pack_bound": (False, True, 16, True, True),
    "one8_pdl_pack_bound_head": (False, True, 8, True, True, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=sorted(CONFIGS),
        default=["one8_pdl", "one8_pdl_pack", "one8_pdl_bound", "one8_pdl_pack_bound", "one8_pdl_pack_bound_head"],
    )
    args = parser.parse_args()
    _sm.ARMS = ()
    _sm.KERNEL_BUDGETS = (4,)
    _sm.PAGES = (4 << 10, 16 << 10, 64 << 10)
    _sm.MATMUL_ARMS = (("sm4", {"method": "sm", "sm_budget": 4}, None), ("dma", {"method": "dma"}, None))
    for rep in range(args.repeats):
        for name in args.configs:
            alternate, pdl, mib, pack, bounded, head = (*CONFIGS[name], False)[:6]
            options = SmOptions(
                slice_bytes=mib * MiB, alternate=alternate, pdl=pdl, pack=pack, bounded=bounded, head=head
            )
            bw = _sm.copy_bandwidth_sm(128 * MiB, options)
            mm = _sm.concurrent_compute(128 * MiB, options)
            shuffled = {k: v for k, v in bw.items() if k.startswith("shuffled")}
            ceiling = {"one_copy_GBps": bw["one_copy_GBps"], "gated": bw["gated"]}
            print(json.dumps({"config": name, "rep": rep, **ceiling, "bw": shuffled, "mm": mm}), flush=True)


if __name__ == "__main__":
    main()
