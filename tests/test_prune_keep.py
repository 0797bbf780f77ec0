"""The scored keep of Prefix-Cache Pruning without a server: the ``knorm`` score and the shared-budget mask
(sgl_sparse/prune/keep.py) against plain references written here, the body checks of ``keep_tokens`` / ``policy``,
and the tree operation of a partial keep (sgl_sparse/prune/tree_ops.py) on SGLang's real radix tree, allocator and
MHA KV pool, whose keys are built so that the positions to keep are known: kept slots stay where they are, dropped ones
are freed (only on nodes no other conversation shares), nothing leaks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

from sgl_sparse.prune import tree_ops
from sgl_sparse.prune.body import BadPruneRequest, parse_body
from sgl_sparse.prune.keep import knorm_scores, pool_scorer, request_prune_leaves, select_keep
from sgl_sparse.prune.spec import PruneSpec
from sgl_sparse.radix.tree import SparseRadixCache
from sgl_sparse.reference import ToyAttentionStack, run_request
from sgl_sparse.registry import create_method
from sgl_sparse.request_methods import EVICTION, MethodResolver
from tests.test_prune import _finished
from tests.test_sparse_tree import POOL, _holes_in, _invariant, _match
from tests.toy_reference import attend_retained

LAYERS, HKV, D = 3, 2, 8


# -- the score and the mask ---------------------------------------------------------------------------

def _ref_knorm(keys: list[torch.Tensor]) -> list[float]:
    """Per token: the sum over layers and heads of minus the key's Euclidean length, one number at a time."""
    n = keys[0].shape[0]
    out = []
    for t in range(n):
        total = 0.0
        for k in keys:
            for h in range(k.shape[1]):
                total -= math.sqrt(sum(float(x) ** 2 for x in k[t, h]))
        out.append(total)
    return out


def _ref_keep(positions: list[int], scores: list[float], keep: int) -> list[int]:
    """The ``keep`` best by (higher score, earlier position), sorted by position."""
    best = sorted(zip(positions, scores), key=lambda ps: (-ps[1], ps[0]))[:max(keep, 0)]
    return sorted(p for p, _ in best)


def test_knorm_scores_match_the_plain_reference() -> None:
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(17, HKV, D, generator=g) * (i + 1) for i in range(LAYERS)]
    got = knorm_scores(iter(keys))
    assert got.dtype == torch.float64 and got.shape == (17,)
    assert torch.allclose(got, torch.tensor(_ref_knorm(keys), dtype=torch.float64), rtol=1e-6, atol=1e-6)
    # bf16 keys are scored in float32 (and summed in float64), not in bf16.
    bf = [k.bfloat16() for k in keys]
    assert torch.allclose(knorm_scores(bf), torch.tensor(_ref_knorm([k.float() for k in bf]), dtype=torch.float64),
                          rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        knorm_scores([])


@pytest.mark.parametrize("seed", range(5))
def test_select_keep_matches_the_plain_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    positions = torch.randperm(200, generator=g)[:60].sort().values
    # Coarse scores: many exact ties, which only the position breaks.
    scores = torch.randint(0, 6, (60,), generator=g).double()
    for keep in (0, 1, 7, 30, 59, 60, 61, 500):
        got = select_keep(positions, scores, keep)
        assert got.tolist() == _ref_keep(positions.tolist(), scores.tolist(), keep), keep


def test_ties_go_to_the_earlier_position_and_a_covering_budget_keeps_all() -> None:
    positions = torch.tensor([3, 4, 5, 10, 11, 12])
    equal = torch.zeros(6, dtype=torch.float64)
    assert select_keep(positions, equal, 4).tolist() == [3, 4, 5, 10]
    assert select_keep(positions, equal, 6).tolist() == positions.tolist()
    assert select_keep(positions, equal, 9).tolist() == positions.tolist()
    assert select_keep(positions, equal, 0).tolist() == []
    # -0.0 and 0.0 are one score: still the earlier position first.
    assert select_keep(torch.tensor([1, 2]), torch.tensor([0.0, -0.0], dtype=torch.float64), 1).tolist() == [1]
    with pytest.raises(ValueError):
        select_keep(positions, equal[:5], 2)


def test_one_budget_is_shared_over_the_union_of_the_ranges() -> None:
    """Two ranges, one of which holds every high score: the whole budget goes there (no per-range quota)."""
    positions = torch.tensor([*range(10, 20), *range(40, 45)])
    scores = torch.tensor([*([-5.0] * 10), -1.0, -2.0, -1.5, -3.0, -4.0], dtype=torch.float64)
    assert select_keep(positions, scores, 4).tolist() == [40, 41, 42, 43]
    assert select_keep(positions, scores, 6).tolist() == [10, 40, 41, 42, 43, 44]


# -- the request body ------------------------------------------------------------------------------

RESOLVER = MethodResolver(create_method("dense"), EVICTION)


def _parse(body: dict[str, Any], page_size: int = 1) -> dict[str, Any]:
    return parse_body(body, lambda text: [1, 2, 3], lambda m: [1, 2, 3], 2048, RESOLVER.resolve, True, page_size)


def test_keep_tokens_and_policy_in_the_body() -> None:
    base = {"token_ids": list(range(1, 41)), "ranges": [[0, 10], [20, 30]]}
    assert (_parse(base)["keep_tokens"], _parse(base)["policy"]) == (0, "drop")
    assert _parse({**base, "keep_tokens": 5})["policy"] == "knorm"  # a keep without a policy: the scored one
    assert _parse({**base, "keep_tokens": 19, "policy": "knorm"})["keep_tokens"] == 19
    assert _parse({**base, "keep_tokens": 0, "policy": "knorm"})["policy"] == "knorm"
    assert _parse({**base, "keep_tokens": 8}, page_size=4)["keep_tokens"] == 8
    # The route serves snapkv_global and kvzip_global too (through an internal request:
    # tests/test_request_prune_e2e.py).
    assert _parse({**base, "keep_tokens": 3, "policy": "snapkv_global"})["policy"] == "snapkv_global"
    assert _parse({**base, "keep_tokens": 3, "policy": "kvzip_global"})["policy"] == "kvzip_global"
    for body, field, words in (
            ({**base, "keep_tokens": 20}, "keep_tokens", "less than the ranges' size, 20"),  # the union's size
            ({**base, "ranges": [[0, 10], [5, 12]], "keep_tokens": 12}, "keep_tokens", "12 tokens"),  # merged
            ({**base, "keep_tokens": 3, "policy": "drop"}, "keep_tokens", "keeps nothing"),
            ({**base, "keep_tokens": 6}, "keep_tokens", "page size 4"),
            ({**base, "keep_tokens": 1.5}, "keep_tokens", "integer"),
            ({**base, "policy": "h2o"}, "policy", "knorm")):
        with pytest.raises(BadPruneRequest) as e:
            _parse(body, page_size=4 if "page size" in words else 1)
        assert e.value.field == field and words in str(e.value), (body, e.value)


def test_keep_ratio_is_a_fraction_of_the_ranges_union_in_whole_pages() -> None:
    base = {"token_ids": list(range(1, 41)), "ranges": [[0, 10], [5, 12], [20, 30]]}  # union: 22 tokens
    assert (_parse({**base, "keep_ratio": 0.5})["keep_tokens"], _parse({**base, "keep_ratio": 0.5})["policy"]) \
        == (11, "knorm")
    assert _parse({**base, "keep_ratio": 0.5}, page_size=4)["keep_tokens"] == 8  # rounded down to whole pages
    assert _parse({**base, "keep_ratio": 0})["keep_tokens"] == 0
    for body, words in (({**base, "keep_ratio": 1.0}, "[0, 1)"), ({**base, "keep_ratio": "half"}, "[0, 1)"),
                        ({**base, "keep_ratio": True}, "[0, 1)"),
                        ({**base, "keep_ratio": 0.5, "keep_tokens": 4}, "not both"),
                        ({**base, "keep_ratio": 0.5, "policy": "drop"}, "keeps nothing")):
        with pytest.raises(BadPruneRequest) as e:
            _parse(body)
        assert e.value.field == "keep_ratio" and words in str(e.value), (body, e.value)


# -- the tree surgery over a real KV pool ------------------------------------------------------------

def _make_with_pool() -> tuple[SparseRadixCache, ReqToTokenPool, TokenToKVPoolAllocator, MHATokenToKVPool]:
    kv = MHATokenToKVPool(size=POOL, page_size=1, dtype=torch.float32, head_num=HKV, head_dim=D, layer_num=LAYERS,
                          device="cpu", enable_memory_saver=False)
    req_pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=1)
    m = create_method("streamingllm")
    return SparseRadixCache(params, m, m.config.fingerprint()), req_pool, alloc, kv


def _write_norms(tree: Any, kv: MHATokenToKVPool, seq: list[int], norm_of: dict[int, float]) -> dict[int, int]:
    """Give position ``p`` of ``seq`` keys of per-head length ``norm_of[p]`` (1.0 elsewhere) in every layer;
    returns each position's slot."""
    slots = _match(tree, seq).device_indices
    for layer in range(LAYERS):
        buf = kv.get_key_buffer(layer)
        for p, slot in enumerate(slots.tolist()):
            v = torch.zeros(HKV, D)
            v[:, (p + layer) % D] = norm_of.get(p, 1.0) * (1 if layer % 2 else -1)
            buf[slot] = v
    return dict(enumerate(slots.tolist()))


def _scorer(kv: MHATokenToKVPool) -> Any:
    return pool_scorer(kv, "knorm", None)


def test_a_scored_keep_keeps_the_lowest_norm_keys_frees_the_rest_and_leaks_nothing() -> None:
    tree, req_pool, alloc, kv = _make_with_pool()
    seq = _finished(tree, req_pool, alloc, "a", list(range(100, 130)), [7, 8], 1)
    # Low key norms (high knorm scores) at 21, 6, 23, 9 and 4, spread over both ranges.
    low = {21: 0.1, 6: 0.2, 23: 0.3, 9: 0.4, 4: 0.5, 30: 0.01}  # 30 is outside the ranges: never in question
    slot_of = _write_norms(tree, kv, seq, low)
    free0 = alloc.available_size()
    r = tree_ops.prune(tree, seq, None, [(4, 12), (20, 26)], keep_tokens=5, score=_scorer(kv))
    assert (r.status, r.matched_tokens, r.pruned_tokens, r.kept_tokens, r.freed_slots, r.resident_tokens) == (
        "completed", 32, 14, 5, 9, 32 - 9), r
    assert alloc.available_size() == free0 + 9 and _invariant(tree, alloc) == 0
    kept = [4, 6, 9, 21, 23]
    dropped = sorted((set(range(4, 12)) | set(range(20, 26))) - set(kept))
    nxt = _match(tree, seq + [1, 2])
    assert len(nxt.device_indices) == 32 and _holes_in(nxt.device_indices) == dropped
    # The kept positions read the very slots they had (nothing moved), the dropped slots are free again.
    assert all(int(nxt.device_indices[p]) == slot_of[p] for p in kept)
    insp = tree_ops.inspect(tree, seq, None)
    assert insp["hidden_ranges"] == [[5, 6], [7, 9], [10, 12], [20, 21], [22, 23], [24, 26]]
    # A drop of the same ranges now takes up only the kept 5; once the pool's LRU evicts it all, the whole pool is
    # free: no slot leaked, none freed twice.
    again = tree_ops.prune(tree, seq, None, [(4, 12), (20, 26)])
    assert (again.pruned_tokens, again.kept_tokens, again.freed_slots) == (5, 0, 5)
    tree.evict(EvictParams(num_tokens=POOL))
    assert alloc.available_size() == POOL and _invariant(tree, alloc) == 0


def test_a_budget_covering_the_resident_tokens_drops_nothing() -> None:
    tree, req_pool, alloc, kv = _make_with_pool()
    seq = _finished(tree, req_pool, alloc, "a", list(range(100, 124)), [3], 1, evicted=(5, 6, 7, 8, 9))
    free0 = alloc.available_size()
    calls: list[int] = []

    def score(slots: Any) -> Any:
        calls.append(len(slots))
        return _scorer(kv)(slots)

    r = tree_ops.prune(tree, seq, None, [(0, 12)], keep_tokens=7, score=score)  # 7 of 12 are resident
    assert (r.status, r.pruned_tokens, r.kept_tokens, r.freed_slots) == ("completed", 7, 7, 0) and not calls, r
    assert alloc.available_size() == free0 and tree_ops.inspect(tree, seq, None)["hidden_tokens"] == 5
    r = tree_ops.prune(tree, seq, None, [(0, 12)], keep_tokens=3, score=score)
    assert (r.pruned_tokens, r.kept_tokens, r.freed_slots) == (7, 3, 4) and calls == [7], r
    assert _invariant(tree, alloc) == 0
    with pytest.raises(ValueError):
        tree_ops.prune(tree, seq, None, [(0, 12)], keep_tokens=2)


def test_a_scored_keep_on_a_shared_prefix_is_copy_on_write() -> None:
    """Positions in the prefix another conversation shares are hidden from this one (kept or not by the score)
    but keep their KV; the other conversation still sees its whole prefix; only the exclusive dropped slots are
    freed, and the score picks across both nodes from one budget."""
    tree, req_pool, alloc, kv = _make_with_pool()
    shared = list(range(100, 120))
    a = _finished(tree, req_pool, alloc, "a", shared + [1, 2, 3, 4, 5, 6], [9], 1)
    b = _finished(tree, req_pool, alloc, "b", shared + [5, 6, 7, 8], [9], 2)
    _write_norms(tree, kv, a, {3: 0.1, 22: 0.2, 5: 0.3})
    free0 = alloc.available_size()
    r = tree_ops.prune(tree, a, None, [(2, 8), (20, 25)], keep_tokens=3, score=_scorer(kv))
    # 11 candidates, 3 kept (3, 5 in the shared node, 22 in a's own), 8 hidden; a's own 20, 21, 23, 24 are freed.
    assert (r.pruned_tokens, r.kept_tokens, r.freed_slots) == (11, 3, 4), r
    assert alloc.available_size() == free0 + 4 and _invariant(tree, alloc) == 0
    assert _holes_in(_match(tree, a + [0]).device_indices) == [2, 4, 6, 7, 20, 21, 23, 24]
    mb = _match(tree, b + [0])
    assert len(mb.device_indices) == len(b) and _holes_in(mb.device_indices) == []
    tree.evict(EvictParams(num_tokens=POOL))
    assert alloc.available_size() == POOL and _invariant(tree, alloc) == 0


# -- a request's own prune with a scored keep (custom_params sgl_sparse_prune + keep_tokens/policy) ---------------

def _request_keep_reference(model: ToyAttentionStack, tokens: list[int], prompt_len: int,
                            ranges: list[tuple[int, int]], keep: int, policy: str) -> tuple[list[int], torch.Tensor]:
    """Plain loops: the prompt through the toy stack densely, then each candidate position (in the ranges) scored
    by ``policy`` (snapkv_global: per layer and KV head, the softmax probability each of the last 32 queries of
    the group's heads gives it, summed, averaged over the 5 positions around it; knorm: minus its keys' norms),
    summed over layers and heads in float64; the ``keep`` best candidates stay (ties: earlier). Then the decode
    over what stays. Returns the retained positions and every output."""
    n_total, w = len(tokens), min(32, prompt_len)
    keys = [torch.zeros(n_total, model.n_kv_heads, model.head_dim) for _ in range(model.n_layers)]
    vals = [torch.zeros_like(keys[0]) for _ in range(model.n_layers)]
    qc = [torch.zeros(0, model.n_heads, model.head_dim) for _ in range(model.n_layers)]
    h = model.embed[torch.tensor(tokens[:prompt_len])]
    outs = []
    for layer in range(model.n_layers):
        h = attend_retained(model, layer, h, 0, prompt_len, list(range(prompt_len)), keys, vals, qc, w, double=True)
    outs.append(h)
    group, d = model.n_heads // model.n_kv_heads, model.head_dim
    total = [0.0] * prompt_len
    for layer in range(model.n_layers):
        for kv in range(model.n_kv_heads):
            if policy == "knorm":
                for c in range(prompt_len):
                    total[c] -= float(keys[layer][c, kv].double().norm())
                continue
            per_key = [0.0] * prompt_len
            for i, pos in enumerate(range(prompt_len - w, prompt_len)):
                for head in range(kv * group, (kv + 1) * group):
                    logits = (keys[layer][: pos + 1, kv].double() @ qc[layer][i, head].double()) / d**0.5
                    for c, pr in enumerate(logits.softmax(0).tolist()):
                        per_key[c] += pr
            for c in range(prompt_len):
                seg = per_key[max(0, c - 2):c + 3]
                total[c] += sum(seg) / len(seg)
    candidates = [p for lo, hi in ranges for p in range(lo, hi)]
    best = sorted(candidates, key=lambda c: (-total[c], c))[:keep]
    retained = [p for p in range(prompt_len) if p not in set(candidates) - set(best)]
    for pos in range(prompt_len, n_total):
        h = model.embed[torch.tensor(tokens[pos:pos + 1])]
        retained.append(pos)
        for layer in range(model.n_layers):
            h = attend_retained(model, layer, h, pos, pos + 1, retained, keys, vals, qc, w, double=True)
        outs.append(h)
    return retained, torch.cat(outs)


@pytest.mark.parametrize(("policy", "ranges", "keep", "chunk"), [
    ("snapkv_global", [(5, 20), (30, 41)], 7, 16),  # 26 candidates, one budget over both ranges
    ("snapkv_global", [(0, 50)], 12, 60),  # the range runs into the window: its queries still score
    ("knorm", [(5, 20), (30, 41)], 7, 16),
])
def test_a_request_scored_keep_equals_plain_loops(policy: str, ranges: list[tuple[int, int]], keep: int,
                                                  chunk: int) -> None:
    """The reference driver's prune at the prompt's end, as the server's (both call request_prune_leaves): the
    ``keep`` positions of the ranges the policy scores highest stay, the rest leave, and the decode reads exactly
    what stays."""
    model = ToyAttentionStack()
    tokens = torch.randint(0, 256, (66,), generator=torch.Generator().manual_seed(5)).tolist()
    trace = run_request(create_method("dense"), model, tokens, prompt_len=60, chunk_size=chunk,
                        prune=PruneSpec(tuple(ranges), keep, policy))
    retained, outs = _request_keep_reference(model, tokens, 60, ranges, keep, policy)
    assert trace.state.kept.tolist() == retained
    assert trace.kept_after_step[-1] == len(retained)
    kept_in_ranges = [p for p in retained if any(lo <= p < hi for lo, hi in ranges)]
    assert len(kept_in_ranges) == keep and kept_in_ranges != [p for lo, hi in ranges for p in range(lo, hi)][:keep]
    torch.testing.assert_close(trace.outputs, outs.float(), rtol=1e-4, atol=1e-4)


def test_a_request_keep_covering_what_is_left_drops_nothing_and_no_score_is_taken() -> None:
    """Fewer retained positions in the ranges than keep_tokens (an earlier eviction took the rest): none leaves,
    and the window is never built (a drop, or nothing to choose, needs no queries)."""
    kept = torch.tensor([0, 1, 2, 9, 10, 30, 31])

    def no_window() -> Any:
        raise AssertionError("scored without a choice to make")

    assert not request_prune_leaves(kept, PruneSpec(((5, 20),), 2, "snapkv_global"), no_window).any()
    assert request_prune_leaves(kept, PruneSpec(((5, 20),)), no_window).tolist() == [False] * 3 + [True] * 2 + \
        [False] * 2


def test_own_prune_reports_what_leaves_and_when_it_could_not_score() -> None:
    """A request's own prune as step.py applies it: the positions that leave, its response's report, and where its
    finish evicts the idle branches; a scored keep that cannot score prunes nothing and says why."""
    from sgl_sparse.prune.keep import own_prune

    kept = torch.tensor([0, 1, 2, 9, 10, 30, 31])

    def no_window() -> Any:
        raise AssertionError("scored without a choice to make")

    out = own_prune(kept, PruneSpec(((5, 20), (30, 31)), evict_branches=True), no_window)
    assert out.leave is not None and out.leave.tolist() == [False] * 3 + [True] * 3 + [False]
    assert out.report == {"status": "applied", "policy": "drop", "pruned_tokens": 3, "kept_tokens": 0}
    assert out.pruned == 3 and out.evict_branches_after == 5
    none = own_prune(kept, PruneSpec(((3, 8),), evict_branches=True), no_window)
    assert none.report["status"] == "nothing_to_prune" and none.pruned == 0 and none.evict_branches_after is None
    unscored = own_prune(kept, PruneSpec(((0, 31),), 2, "kvzip_global"), no_window)
    assert unscored.leave is None and unscored.pruned == 0 and unscored.report["status"] == "unscored"
    assert unscored.report["kept_tokens"] == 6 and "no replay forwards" in unscored.report["message"]
