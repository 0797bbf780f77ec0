"""SparseRadixCache against SGLang's real pools, allocator and radix tree (no server).

The request object is a minimal stand-in carrying the fields the tree reads; the tree, the
``ReqToTokenPool`` and the ``TokenToKVPoolAllocator`` are SGLang 0.5.17's own classes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sgl_sparse import create_method
from sgl_sparse.radix.tree import SENTINEL_SLOT, SparseRadixCache

POOL = 64


@dataclass
class FakeReq:
    rid: str
    origin_input_ids: list[int] | array
    output_ids: list[int] | array = field(default_factory=list)
    req_pool_idx: int = 0
    cache_protected_len: int = 0
    extra_key: str | None = None
    last_node: Any = None
    priority: int = 0
    prefix_indices: torch.Tensor | None = None
    fill_len: int = 0

    def __post_init__(self) -> None:  # SGLang keeps token ids in array("q")
        self.origin_input_ids = array("q", self.origin_input_ids)
        self.output_ids = array("q", self.output_ids)

    def get_fill_ids(self) -> array:
        return (self.origin_input_ids + self.output_ids)[: self.fill_len]


def _make(tree_cls: type = SparseRadixCache, method: str = "streamingllm") -> tuple[Any, ReqToTokenPool, Any]:
    req_pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", None, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=1)
    if tree_cls is RadixCache:
        return RadixCache(params), req_pool, alloc
    m = create_method(method)
    return SparseRadixCache(params, m, m.config.fingerprint()), req_pool, alloc


def _invariant(tree: Any, alloc: Any) -> int:
    """SGLang's idle leak check: available + evictable + protected - total (0 when sound)."""
    return alloc.available_size() + tree.evictable_size() + tree.protected_size() - POOL


def _admit(tree: Any, req_pool: ReqToTokenPool, alloc: Any, req: FakeReq, row: int) -> None:
    """What SGLang does at admission: match, lock, allocate the rest, write the row."""
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", req.origin_input_ids), req.extra_key)))
    req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
    req.cache_protected_len = len(req.prefix_indices)
    tree.inc_lock_ref(req.last_node)
    req.req_pool_idx = row
    n = len(req.origin_input_ids) + len(req.output_ids)
    new = alloc.alloc(n - len(req.prefix_indices))
    req_pool.req_to_token[row, : len(req.prefix_indices)] = req.prefix_indices.to(torch.int32)
    req_pool.req_to_token[row, len(req.prefix_indices): n] = new.to(torch.int32)


def _evict_positions(req_pool: ReqToTokenPool, alloc: Any, req: FakeReq, positions: list[int]) -> None:
    """What our eviction step does: free request-owned slots, sentinel every dropped position."""
    row = req_pool.req_to_token[req.req_pool_idx]
    owned = [p for p in positions if p >= req.cache_protected_len]
    alloc.free(row[owned].long())
    row[positions] = SENTINEL_SLOT


def test_stock_tree_breaks_on_sentinels_negative_control() -> None:
    tree, req_pool, alloc = _make(RadixCache)
    req = FakeReq("a", list(range(10, 30)))
    _admit(tree, req_pool, alloc, req, 1)
    _evict_positions(req_pool, alloc, req, [3, 4, 5, 6])
    tree.cache_finished_req(req, kv_len_to_handle=20)
    assert _invariant(tree, alloc) != 0  # counts 4 phantom slots


def test_finish_match_split_lock_evict_keep_invariant_and_never_free_slot0() -> None:
    tree, req_pool, alloc = _make()
    a = FakeReq("a", list(range(100, 120)), output_ids=[7, 8, 9])
    _admit(tree, req_pool, alloc, a, 1)
    _evict_positions(req_pool, alloc, a, [2, 3, 4, 5, 10, 11])
    assert _invariant(tree, alloc) < 0  # request-owned slots are neither free nor in the tree yet
    tree.cache_finished_req(a, kv_len_to_handle=23)
    assert _invariant(tree, alloc) == 0
    assert tree.evictable_size() == 23 - 6 and tree.total_size() == 17

    # A continuation matches the whole logical prefix, sentinels included (Chain Cache).
    b = FakeReq("b", list(range(100, 120)) + [7, 8, 9, 50, 51])
    _admit(tree, req_pool, alloc, b, 2)
    assert len(b.prefix_indices) == 23
    assert (b.prefix_indices == SENTINEL_SLOT).sum().item() == 6
    assert tree.protected_size() == 17 and tree.evictable_size() == 0
    assert _invariant(tree, alloc) + 2 == 0  # the 2 new slots are request-owned

    # A second request splits the node inside the sentinel range, then everyone finishes.
    c = FakeReq("c", list(range(100, 104)) + [1, 2, 3])
    _admit(tree, req_pool, alloc, c, 3)
    assert len(c.prefix_indices) == 4 and c.prefix_indices.tolist()[2:] == [0, 0]
    tree.cache_finished_req(c, kv_len_to_handle=7)
    tree.cache_finished_req(b, kv_len_to_handle=25)
    assert _invariant(tree, alloc) == 0
    assert SENTINEL_SLOT not in alloc.free_pages.tolist()

    tree.evict(EvictParams(num_tokens=POOL))
    assert tree.evictable_size() == 0 and tree.protected_size() == 0
    assert alloc.available_size() == POOL
    assert sorted(alloc.free_pages.tolist()) == list(range(1, POOL + 1))


def test_continuation_hides_tree_owned_positions_and_finish_compacts_the_path() -> None:
    tree, req_pool, alloc = _make()
    a = FakeReq("a", list(range(200, 216)))
    _admit(tree, req_pool, alloc, a, 1)
    tree.cache_finished_req(a, kv_len_to_handle=16)
    assert tree.total_size() == 16

    b = FakeReq("b", list(range(200, 216)) + [1, 2, 3, 4])
    _admit(tree, req_pool, alloc, b, 2)
    # b's method drops tree-owned positions 4..9 (hidden) and its own position 17 (freed).
    _evict_positions(req_pool, alloc, b, [4, 5, 6, 7, 8, 9, 17])
    assert tree.total_size() == 16  # still locked by b: untouched
    tree.cache_finished_req(b, kv_len_to_handle=20)
    # The path now holds b's kept set: 20 logical, 7 sentinels, 13 physical.
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", list(range(200, 216)) + [1, 2, 3, 4]))))
    assert len(m.device_indices) == 20 and (m.device_indices == SENTINEL_SLOT).sum().item() == 7
    assert tree.total_size() == 13 and _invariant(tree, alloc) == 0


def test_locked_path_is_not_compacted() -> None:
    tree, req_pool, alloc = _make()
    a = FakeReq("a", list(range(300, 310)))
    _admit(tree, req_pool, alloc, a, 1)
    tree.cache_finished_req(a, kv_len_to_handle=10)
    b = FakeReq("b", list(range(300, 310)) + [5])
    c = FakeReq("c", list(range(300, 310)) + [6])
    _admit(tree, req_pool, alloc, b, 2)
    _admit(tree, req_pool, alloc, c, 3)
    _evict_positions(req_pool, alloc, b, [1, 2])
    tree.cache_finished_req(b, kv_len_to_handle=11)  # c still holds the shared prefix
    assert tree.total_size() == 10 + 1  # shared prefix intact (c holds it) + b's own token
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", list(range(300, 310))))))
    assert (m.device_indices == SENTINEL_SLOT).sum().item() == 0
    tree.cache_finished_req(c, kv_len_to_handle=11)
    assert _invariant(tree, alloc) == 0


def test_namespaces_never_share_kv() -> None:
    req_pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", None, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=1)
    a_m = create_method("streamingllm", {"recent_tokens": 100})
    b_m = create_method("streamingllm", {"recent_tokens": 200})
    tree_a = SparseRadixCache(params, a_m, a_m.config.fingerprint())
    req = FakeReq("a", list(range(10, 20)))
    _admit(tree_a, req_pool, alloc, req, 1)
    tree_a.cache_finished_req(req, kv_len_to_handle=10)
    key = RadixKey(array("q", list(range(10, 20))))
    assert len(tree_a.match_prefix(MatchPrefixParams(key=key)).device_indices) == 10
    tree_a.fingerprint = b_m.config.fingerprint()  # same tree, another config's requests
    assert len(tree_a.match_prefix(MatchPrefixParams(key=key)).device_indices) == 0


@pytest.mark.parametrize("method", ["dense", "streamingllm"])
def test_unfinished_chunks(method: str) -> None:
    tree, req_pool, alloc = _make(method=method)
    a = FakeReq("a", list(range(400, 420)), fill_len=8)
    _admit(tree, req_pool, alloc, a, 1)
    tree.cache_unfinished_req(a)
    assert len(a.prefix_indices) == 8
    # Evicting methods keep the prompt request-owned until finish; dense inserts each chunk.
    assert tree.total_size() == (8 if method == "dense" else 0)
    tree.cache_finished_req(a, kv_len_to_handle=20)
    assert tree.total_size() == 20 and _invariant(tree, alloc) == 0
