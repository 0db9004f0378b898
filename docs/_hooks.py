"""mkdocs hooks for the aiokvtier site.

- Links from a page to files outside docs/ (``../examples/x.py``) are right
  on the repository's web view and broken on the site; there they become
  ``{repo_url}/blob/main/examples/x.py``.
- The API reference lays out a long signature with a code formatter, Ruff
  (the docs extra installs it) or Black, and prints it on one line where
  neither is importable. So that the pages do not depend on what else is
  installed, a build without either warns (and ``--strict`` fails).
"""

from __future__ import annotations

import importlib.util
import logging
import re
from typing import Any

_OUTSIDE = re.compile(r"\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")
_log = logging.getLogger("mkdocs.hooks.aiokvtier")


def on_startup(command: str, dirty: bool) -> None:
    if not any(importlib.util.find_spec(name) for name in ("ruff", "black")):
        _log.warning("the API reference's signatures need Ruff to be laid out: pip install '.[docs]'")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    repo = str(config.get("repo_url") or "").rstrip("/")
    if not repo:
        return markdown
    return _OUTSIDE.sub(lambda m: f"]({repo}/blob/main/{m.group(1)}{m.group(2) or ''})", markdown)
