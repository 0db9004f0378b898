"""mkdocs hooks for the aiokvtier site.

- Links from a page to files outside docs/ (``../examples/x.py``) are right
  on the repository's web view and broken on the site; there they become
  ``{repo_url}/blob/main/examples/x.py``.
- The API reference is rendered from Sphinx-style field lists. Where such a
  list does not follow griffe's grammar (``:param:`` for a pydantic field,
  which has no ``__init__`` parameter of that name; a ``:raises:`` without a
  type), griffe warns; those warnings are shown as INFO, so that ``mkdocs
  build --strict`` fails on broken links, anchors and missing objects, not on
  the wording of a docstring.
"""

from __future__ import annotations

import logging
import re
from typing import Any

_OUTSIDE = re.compile(r"\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")
_DOCSTRING_GRAMMAR = re.compile(
    r"No matching parameter for|does not appear in the function signature|Failed to parse exception directive"
)


class _DocstringGrammar(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and _DOCSTRING_GRAMMAR.search(record.getMessage()):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def on_startup(command: str, dirty: bool) -> None:
    logger = logging.getLogger("mkdocs.plugins.griffe")
    if not any(isinstance(f, _DocstringGrammar) for f in logger.filters):
        logger.addFilter(_DocstringGrammar())


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    repo = str(config.get("repo_url") or "").rstrip("/")
    if not repo:
        return markdown
    return _OUTSIDE.sub(lambda m: f"]({repo}/blob/main/{m.group(1)}{m.group(2) or ''})", markdown)
