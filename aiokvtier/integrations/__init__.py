"""Adapters that let serving engines load aiokvtier by configuration.

Each adapter is a submodule that imports its engine (and torch) when it is
imported, and only then: ``import aiokvtier.integrations`` imports nothing
heavy, and the base install pulls in no engine.

- ``aiokvtier.integrations.vllm``: an ``OffloadingSpec`` for vLLM's
  ``OffloadingConnector`` (``pip install 'aiokvtier[vllm]'``; see
  docs/integrations/vllm.md).
- ``aiokvtier.integrations.sglang``: a ``HiCacheStorage`` for SGLang's
  hierarchical cache (``pip install 'aiokvtier[sglang]'``; see
  docs/integrations/sglang.md).
- ``aiokvtier.integrations.lmcache``: an L2 adapter for LMCache's
  multi-process server (``pip install 'aiokvtier[lmcache]'``; see
  docs/integrations/lmcache.md).
"""

from __future__ import annotations

__all__: list[str] = []
