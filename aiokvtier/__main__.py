"""``python -m aiokvtier``: the ``aiokvtier`` command (``demo``, ``doctor``, ``bench``)."""

from __future__ import annotations

from ._cli import main

if __name__ == "__main__":
    main(prog="python -m aiokvtier")
