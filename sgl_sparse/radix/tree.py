"""``SparseRadixCache``: SGLang's radix tree, owned by sgl_sparse.

With the ``dense`` method it is the stock ``RadixCache``: one physical slot per logical token, the
same matching, insertion, locking and eviction. It exists as our class from the start because the
eviction family needs a tree whose node values may hold sentinel slots (evicted positions), whose
sizes count physical slots and whose namespace is the method fingerprint (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

from sgl_sparse.contract import SparseMethod


class SparseRadixCache(RadixCache):
    def __init__(self, params: CacheInitParams, method: SparseMethod[Any], fingerprint: str) -> None:
        super().__init__(params)
        self.method = method
        self.fingerprint = fingerprint

    def stats(self) -> dict[str, Any]:
        """Tree-side numbers for ``/server_info`` (physical slots)."""
        return {
            "tree_evictable_slots": int(self.evictable_size()),
            "tree_protected_slots": int(self.protected_size()),
        }
