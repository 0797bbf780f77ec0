"""Prefix-Cache Pruning on the Chain Cache tree (:class:`~sgl_sparse.radix.tree.SparseRadixCache`): drop the KV of
chosen logical ranges of a cached sequence while its token prefix still matches (docs/prefix-cache-pruning.md).

A prune is a Chain Cache decision taken from outside a request: the sequence's visible kept set loses the
pruned positions and is stored as a :class:`ChainRecord` on the node that ends the sequence, exactly as a
finishing eviction request stores its own. So it is **copy-on-write** by the same rules:

* a continuation (a request that matches through the sequence's end) sees the pruned view: the pruned
  positions are hidden, the rest of the prefix is a cache hit, and it prefills only its new suffix;
* KV is freed only on nodes exclusive to that sequence (no other branch below them, no lock); nodes
  another conversation shares keep their KV, and that conversation keeps seeing it whole;
* every other request never sees a hole (its match stops at the first one, as for any record it does not
  continue).

``evict_branches`` (off by default) first evicts the idle cached branches that hang off the sequence's path
at or after the first pruned position (not its continuations), as the pool's LRU would: in an agent loop the
previous turn's reply *as generated* is such a branch whenever the template re-renders it differently, and it
alone keeps the tool results above it shared. Its conversation only loses a cache entry (its next request
prefills from the branch point); nothing another request reads changes.

A **scored keep** (``keep_tokens`` > 0) keeps that many of the ranges' resident positions, one budget shared over
their union, chosen by ``score`` (the pool's keys of those positions, summed over the TP group: the policies are
:mod:`sgl_sparse.prune.keep`); the rest of the ranges is dropped as above. The kept positions stay resident (on shared
nodes and exclusive ones alike), so a continuation reads them where they are.

It runs in the scheduler between batches (a control request), identically on every TP rank. A path that a
running request holds (``lock_ref > 0`` on a node the ranges touch) is ``blocked``: changing its view would
change KV that request is reading, so nothing is done and the caller may retry.

Written against the tree's public API (``view_of``, ``node_ending_at``, ``path_to``, ``evict_side_branches``,
``compact_exclusive``) and its node records (:mod:`sgl_sparse.radix.records`); no SGLang import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sgl_sparse.prune.keep import select_keep
from sgl_sparse.radix.records import ChainRecord, node_record, void_continuations
from sgl_sparse.slots import complement

if TYPE_CHECKING:
    from sgl_sparse.radix.tree import SparseRadixCache

COMPLETED, BLOCKED, FAILED = "completed", "blocked", "failed"


@dataclass
class PruneResult:
    status: str  # completed | blocked | failed
    message: str = ""
    matched_tokens: int = 0  # visible cached tokens of the sequence
    pruned_tokens: int = 0  # resident positions of the ranges the prune took up (scored, or dropped)
    kept_tokens: int = 0  # of them, resident still (the scored keep; 0 with drop): pruned - kept are now hidden
    freed_slots: int = 0  # KV slots returned to the pool (exclusive nodes only: shared ones keep theirs)
    resident_tokens: int = 0  # resident positions a continuation now sees (the whole sequence)
    evicted_branch_slots: int = 0  # KV slots of idle other branches evicted first (``evict_branches``)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


Scorer = Callable[[torch.Tensor], torch.Tensor]  # slots (pool device) -> one score per slot (CPU), TP-reduced


def prune(tree: SparseRadixCache, token_ids: list[int], extra_key: str | None, ranges: list[tuple[int, int]],
          keep_tokens: int = 0, score: Scorer | None = None, evict_branches: bool = False) -> PruneResult:
    """Hide ``ranges`` (logical ``[L, R)``, within the cached sequence) from ``token_ids``'s continuations and
    free what only that sequence held (after evicting the other idle branches below the first range when
    ``evict_branches``); with ``keep_tokens`` > 0, all but the ``keep_tokens`` resident positions
    of the ranges that ``score`` (called with their slots) ranks highest, ties to the earlier position."""
    if keep_tokens > 0 and score is None:
        raise ValueError("a scored keep (keep_tokens > 0) needs a scorer")
    if not tree.evicting:
        return PruneResult(FAILED, "this server reads SGLang's stock attention lists, which cannot skip pruned "
                                   "KV: start it with an eviction method or --sparse-request-methods eviction")
    view = tree.view_of(token_ids, extra_key)
    end = max(r for _, r in ranges)
    if view.length < end:
        return PruneResult(FAILED, f"the tree serves only the first {view.length} of these tokens (never cached, "
                                   f"evicted, or hidden by an earlier prune or eviction); ranges end at {end}",
                           matched_tokens=view.length)
    n = view.length
    in_ranges = torch.zeros(n, dtype=torch.bool)
    for lo, hi in ranges:
        in_ranges[lo:hi] = True
    resident = int(view.kept.numel())
    cand = view.kept[in_ranges[view.kept]]
    busy = [s for node, s in zip(view.nodes, view.starts)
            if node.lock_ref > 0 and bool(in_ranges[s:s + len(node.key)].any())]
    if busy:
        return PruneResult(BLOCKED, f"a running request holds this prefix (at position {busy[0]}); retry when it "
                                    "has finished", matched_tokens=n, resident_tokens=resident)
    if not cand.numel():
        return PruneResult(COMPLETED, "nothing resident in the ranges", matched_tokens=n, resident_tokens=resident)
    if keep_tokens >= cand.numel():
        return PruneResult(COMPLETED, f"the ranges hold {cand.numel()} resident tokens, no more than keep_tokens "
                                      f"{keep_tokens}: nothing dropped", matched_tokens=n,
                           pruned_tokens=int(cand.numel()), kept_tokens=int(cand.numel()), resident_tokens=resident)
    keep = cand[:0]
    if keep_tokens > 0:
        assert score is not None
        scores = score(view.slots[cand.to(view.slots.device)])
        keep = select_keep(cand, scores.cpu(), keep_tokens)
    hide = cand[~torch.isin(cand, keep)]
    kept = view.kept[~torch.isin(view.kept, hide)]
    # The record goes on the node that ends the sequence (split there if a longer branch runs through it).
    last = tree.node_ending_at(view.nodes, view.starts, n)
    path = tree.path_to(last)
    evicted = tree.evict_side_branches(path, min(lo for lo, _ in ranges)) if evict_branches else 0
    before = tree.token_to_kv_pool_allocator.available_size()
    tree.compact_exclusive(path, complement(kept, n), own_tail=True)
    freed = int(tree.token_to_kv_pool_allocator.available_size() - before)
    void_continuations(last, hide)
    # A payload describes a finished request's retained set; with positions removed it no longer does.
    node_record(last).chain = ChainRecord(n, kept.clone(), None, since=n)
    return PruneResult(COMPLETED, matched_tokens=n, pruned_tokens=int(cand.numel()), kept_tokens=int(keep.numel()),
                       freed_slots=freed, resident_tokens=int(kept.numel()), evicted_branch_slots=evicted)


def inspect(tree: SparseRadixCache, token_ids: list[int], extra_key: str | None) -> dict[str, Any]:
    """The sequence's match as the tree serves it: visible, resident and hidden tokens (and the hidden positions as
    ``[start, end)`` runs), and its path of nodes."""
    view = tree.view_of(token_ids, extra_key)
    nodes = []
    for node, s in zip(view.nodes, view.starts):
        info = node_record(node)
        rec = info.chain
        nodes.append({"start": s, "tokens": len(node.key), "resident": info.phys,
                      "in_use": node.lock_ref > 0, "shared": len(node.children) > 1,
                      "record": None if rec is None else {"end": rec.end, "kept": int(rec.kept.numel()),
                                                         "since": rec.since}})
    return {"matched_tokens": view.length, "resident_tokens": int(view.kept.numel()),
            "hidden_tokens": view.length - int(view.kept.numel()),
            "hidden_ranges": runs(complement(view.kept, view.length)), "nodes": nodes}


def runs(positions: torch.Tensor) -> list[list[int]]:
    """Sorted positions as ``[[start, end), ...]`` runs of consecutive ones."""
    if not positions.numel():
        return []
    p = positions.tolist()
    cuts = [i for i in range(1, len(p)) if p[i] != p[i - 1] + 1]
    bounds = [0, *cuts, len(p)]
    return [[p[a], p[b - 1] + 1] for a, b in zip(bounds, bounds[1:])]
