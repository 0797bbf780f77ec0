"""``SparseRadixCache``: SGLang's radix tree whose node values may hold sentinel slots.

A node value holds one KV slot per logical token; an evicted position holds ``SENTINEL_SLOT`` (0,
SGLang's padding slot, which the allocator never hands out). Versus the stock ``RadixCache``:

* every size (evictable, protected, total) counts *physical* slots (``node.phys``), so SGLang's idle
  leak check ``available + evictable + protected == total`` holds;
* every free skips sentinels (freeing slot 0 would put it into the free list, and SGLang would
  hand it out and overwrite the padding slot);
* keys are namespaced by the method fingerprint: compacted KV of one config is never matched by a
  request under another config (or by a dense one);
* for evicting methods, a request's KV enters the tree only when it finishes (``cache_finished_req``);
  while it runs it owns its slots, so its method may free them. After insertion, positions of the
  matched (tree-owned) prefix that the request hid are turned into sentinels too when no other
  request holds that path (``_compact_path``): the next turn resumes from this turn's kept set
  (Chain Cache).

With a non-evicting method (``dense``) no sentinel ever exists and the behaviour is the stock one.
"""

from __future__ import annotations

import heapq
import time
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_sparse.contract import SparseMethod
from sgl_sparse.integration import SENTINEL_SLOT


def physical(value: torch.Tensor | None) -> int:
    """Number of non-sentinel slots in a node value (one host sync on GPU)."""
    if value is None or value.numel() == 0:
        return 0
    return int((value != SENTINEL_SLOT).sum().item())


def live(slots: torch.Tensor) -> torch.Tensor:
    """``slots`` without sentinels: what may be handed back to the allocator."""
    return slots[slots != SENTINEL_SLOT]


class SparseRadixCache(RadixCache):
    def __init__(self, params: CacheInitParams, method: SparseMethod[Any], fingerprint: str,
                 on_finish: Any = None) -> None:
        self.method = method
        self.fingerprint = fingerprint
        self.evicting = method.evicts
        self._on_finish = on_finish  # runtime callback(req): drop per-request state
        super().__init__(params)

    # -- namespace -------------------------------------------------------------------------------
    def _ns(self, key: RadixKey) -> RadixKey:
        """Only the public entry points (``match_prefix``, ``insert``) call this, once per key."""
        extra = self.fingerprint if key.extra_key is None else f"{self.fingerprint}:{key.extra_key}"
        return RadixKey(key.token_ids, extra, is_bigram=key.is_bigram, limit=key.limit)

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        return super().match_prefix(MatchPrefixParams(key=self._ns(params.key), cow_mamba=params.cow_mamba,
                                                      req=params.req))

    def insert(self, params: InsertParams) -> InsertResult:
        params.key = self._ns(params.key)
        return super().insert(params)

    # -- physical sizes --------------------------------------------------------------------------
    def _phys_of(self, value: torch.Tensor | None) -> int:
        # Without eviction there are no sentinels: skip the device->host sync.
        if not self.evicting:
            return 0 if value is None else int(value.numel())
        return physical(value)

    def reset(self) -> None:
        super().reset()
        self.root_node.phys = 0

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        new_node = super()._split_node(key, child, split_len)
        new_node.phys = self._phys_of(new_node.value)
        child.phys = self._phys_of(child.value)
        return new_node

    def _insert_helper(self, node: TreeNode, key: RadixKey, value: torch.Tensor, priority: int = 0,
                       chunked: bool = False) -> tuple[int, TreeNode]:
        prefix_len, last = super()._insert_helper(node, key, value, priority, chunked)
        if not hasattr(last, "phys"):  # a new leaf: the stock code counted len(key) slots
            last.phys = self._phys_of(last.value)
            self.evictable_size_ -= len(last.key) - last.phys
        return prefix_len, last

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        self.evictable_size_ += len(node.key) - node.phys

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= node.phys
                self.protected_size_ += node.phys
                delta -= node.phys
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node: TreeNode, params: Any = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 1:
                self.evictable_size_ += node.phys
                self.protected_size_ -= node.phys
                delta += node.phys
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return DecLockRefResult(delta=delta)

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        start_time = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < params.num_tokens and heap:
            _, x = heapq.heappop(heap)
            self.token_to_kv_pool_allocator.free(live(x.value))
            num_evicted += x.phys
            self._delete_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
            self._record_remove_event(x)
        self.update_eviction_metrics(num_evicted, start_time)
        return EvictResult(num_tokens_evicted=num_evicted)

    def _total_size_helper(self) -> int:
        total, stack = 0, [self.root_node]
        while stack:
            node = stack.pop()
            total += getattr(node, "phys", 0)
            stack.extend(c for c in node.children.values() if not c.evicted)
        return total

    # -- request lifecycle -----------------------------------------------------------------------
    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int) -> None:
        if self._on_finish is not None:
            self._on_finish(req)
        if not self.evicting:
            return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        alloc = self.token_to_kv_pool_allocator
        if self.disable or self.disable_finished_insert:
            is_insert = False
        if self.disable:
            alloc.free(live(row[req.cache_protected_len:kv_len_to_handle]))
            return
        token_ids = (req.origin_input_ids + req.output_ids)[:kv_len_to_handle]
        kv_indices = row[: len(token_ids)]
        key = RadixKey(token_ids, req.extra_key)
        key_len = len(key)
        freed_end = key_len
        if is_insert:
            values = kv_indices[:key_len].to(dtype=torch.int64, copy=True)
            priority = getattr(req, "priority", 0) or 0
            freed_end = self.insert(InsertParams(key=key, value=values, priority=priority)).prefix_len
        alloc.free(live(torch.cat([kv_indices[req.cache_protected_len:freed_end], kv_indices[key_len:]])))
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        if is_insert:
            self._compact_path(self._ns(key), kv_indices[:key_len])

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        if not self.evicting:
            return super().cache_unfinished_req(req, chunked)
        # Defer insertion to finish: the prompt stays request-owned, so the method may free it. The
        # next chunk continues after what is filled so far (as SGLang's ChunkCache does).
        if self.disable:
            return
        fill_len = len(req.get_fill_ids())
        req.prefix_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, :fill_len].to(
            dtype=torch.int64, copy=True)

    def _compact_path(self, key: RadixKey, row: torch.Tensor) -> None:
        """Turn tree-owned positions the finished request had hidden (sentinel in its row) into
        sentinels in the tree too, on nodes no running request holds."""
        node, pos = self.root_node, 0
        while pos < len(key):
            child = node.children.get(key[pos:].child_key(self.page_size))
            if child is None:
                return
            n = len(child.key)
            if child.lock_ref == 0 and child.phys > 0:
                hide = (row[pos:pos + n] == SENTINEL_SLOT) & (child.value != SENTINEL_SLOT)
                count = int(hide.sum().item())
                if count:
                    self.token_to_kv_pool_allocator.free(child.value[hide])
                    child.value[hide] = SENTINEL_SLOT
                    child.phys -= count
                    self.evictable_size_ -= count
            node, pos = child, pos + n

    def stats(self) -> dict[str, Any]:
        """Tree-side numbers for ``/server_info`` (physical slots)."""
        return {
            "tree_evictable_slots": int(self.evictable_size()),
            "tree_protected_slots": int(self.protected_size()),
        }
