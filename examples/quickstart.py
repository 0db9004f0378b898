"""Open a host tier, allocate while it fills, write a KV page, resize, close."""

from __future__ import annotations

from aiokvtier import _program

with _program.starting():  # a Ctrl-C during the slow imports ends the example at once, without a traceback
    from aiokvtier import HostTier, HostTierConfig


async def main() -> None:
    config = HostTierConfig(quota="256MiB", max_quota="1GiB", slot_size="256KiB")
    async with HostTier(config) as tier:
        slot = await tier.allocate()  # waits only for the first (4 MiB) unit
        page = tier.view(slot)
        page[:11] = b"hello, kv!\n"
        batch = await tier.allocate(64)
        print("first slot", slot, "batch", batch[0], "..", batch[-1], tier)
        tier.free_many(batch)
        await tier.resize("512MiB")  # grows inside the reservation: the base never moves
        await tier.wait_resident()
        print(tier.statistics().resident_bytes >> 20, "MiB resident;", tier.placement())
        page.release()


def cli() -> None:
    _program.Parser(prog="quickstart.py", description=(__doc__ or "").split("\n\n")[0]).parse_args()
    _program.run_async(main())


if __name__ == "__main__":
    # By the aiokvtier command's conventions: --help, one-line errors (exit 2), Ctrl-C closes the tier
    # and ends by SIGINT, a closed stdout ends quietly.
    _program.run(cli, name="quickstart.py")
