"""``python -m aiokvtier.server``: the KV block service (see ``aiokvtier.server``)."""

from __future__ import annotations

import sys

from ._command import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m aiokvtier.server"))
