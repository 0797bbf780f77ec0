"""The scored keep of Prefix-Cache Pruning (docs/prefix-cache-pruning.md): which ``keep_tokens`` of a prune's ranges
keep their KV. Pure torch (no SGLang import), tested against plain references; the route reads the keys from the KV
pool (:func:`pool_scorer`), the TP group sums the scores, and the tree operation (:mod:`sgl_sparse.prune.tree_ops`)
keeps the best of them.

Between batches (``POST /v1/prefix_cache/prune``) a prune has the pool's K and V of every resident position, but
not the queries of the forwards that wrote them, so it scores query-agnostically:

* ``knorm``: KnormPress's score (NVIDIA kvpress ``knorm_press.py``; Devoto et al. 2024, "A Simple and Effective
  L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430): a key of low L2 norm draws high attention,
  so a position scores ``-||k||``. RoPE rotates pairs of dimensions, so the norm of the pool's post-RoPE key is
  the norm of the pre-RoPE one. One global mask per position, as SparseEngine's prune (one budget shared over the
  union of the ranges): the score is summed over layers and KV heads (in float64); a layer whose keys are larger
  weighs more in that sum. Under TP each rank sums its own heads and the ranks sum their sums (an all-reduce), so
  every rank keeps the same positions.
* ``drop``: keeps nothing (``keep_tokens`` 0).

A request's own prune (``custom_params['sgl_sparse_prune']``, docs/prefix-cache-pruning.md "Per request") runs in
the step that completes the prompt, where the prompt's last queries exist and the model can run again, so it
serves two more policies (the route serves them too, by sending the sequence as such a request):

* ``snapkv_global``: SparseEngine's token-shared SnapKV (one mask per position): SnapKV's score
  (:func:`sgl_sparse.methods.eviction.base.observation_scores`, with SnapKV's defaults: the last 32 queries,
  average pooling over 5 positions) of each retained key, the softmax over every retained key of the request,
  summed over heads and layers; the ``keep_tokens`` highest of the ranges' retained positions stay.
* ``kvzip_global``: SparseEngine's token-shared KVzip: the ranges are reconstructed, chunk by chunk, by replay
  forwards (the ``kvzip`` method's, :func:`sgl_sparse.methods.eviction.kvzip.range_replays`: KVzip's instructions,
  chunks of 2,048, the 8 tokens before a chunk repeated, 4 sink tokens in each softmax) that attend the whole
  retained prompt; a position's score is the most attention any query of any head of any layer gives it while
  its chunk is reconstructed; the ``keep_tokens`` highest stay. Like the method, the softmax is chunk-local (sink,
  chunk, replay), where SparseEngine's spans the whole context. Costs about one more prefill of the ranges.

Ties go to the earlier position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import ObservationWindow
from sgl_sparse.prune.spec import (
    KNORM,
    KVZIP_GLOBAL,
    SNAPKV_GLOBAL,
    SNAPKV_KERNEL,
    SNAPKV_POOLING,
    SNAPKV_WINDOW,
    PruneSpec,
)
from sgl_sparse.rules import in_ranges


class PruneUnscored(RuntimeError):
    """A scored keep that could not score (``kvzip_global`` with no room for a replay): nothing is pruned."""


@dataclass(frozen=True)
class ReplayInputs:
    """What ``kvzip_global`` scores with: the prompt's ``token_ids`` (at least up to the last range's end), the
    ``kvzip`` config of its replays (instructions, chunk size, sink; ``KVzipConfig``), the most tokens a replay may
    have (``max_tokens``: the row, the model's context, the free and tree-evictable slots), and
    ``run(replays, scorer)``, which runs the replays of the request and hands each layer to
    ``scorer.on_replay_layer`` (the server's
    ``integration/replay.py``, the reference driver's own loop)."""

    token_ids: Sequence[int]
    config: Any
    max_tokens: int
    run: Callable[[list[Any], Any], None]
    # Under TP: the scores' maximum over the ranks (each scored its own heads); None with one rank.
    max_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None


def knorm_scores(keys: Iterable[torch.Tensor]) -> torch.Tensor:
    """Per position, the sum over layers and KV heads of ``-||k||_2``: ``keys`` yields one ``[n, H_kv, D]`` tensor
    per layer (the heads this rank holds; one layer at a time, so a caller may gather them lazily). Returns
    ``[n]`` float64 on the keys' device."""
    total: torch.Tensor | None = None
    for k in keys:
        s = -torch.linalg.vector_norm(k.float(), dim=-1).double().sum(dim=-1)
        total = s if total is None else total + s
    if total is None:
        raise ValueError("knorm_scores: no layer of keys")
    return total


def select_keep(positions: torch.Tensor, scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` of ``positions`` (sorted CPU int64) with the highest ``scores`` (aligned with them), sorted;
    ties go to the earlier position. ``keep >= len(positions)`` keeps them all, ``keep <= 0`` none."""
    n = positions.numel()
    if scores.shape != (n,):
        raise ValueError(f"select_keep: {tuple(scores.shape)} scores for {n} positions")
    if keep >= n:
        return positions
    if keep <= 0:
        return positions[:0]
    # A stable sort of the negated scores: equal scores stay in position order, so the earlier one goes first.
    order = torch.argsort(-scores.detach().double().cpu(), stable=True)[:keep]
    return positions[order.sort().values]


def policy_scores(policy: str, window: ObservationWindow) -> torch.Tensor:
    """``[n]`` scores (CPU float64) of ``window``'s retained keys (``window.k_pos``) under ``policy``, summed over
    every head of the model (``window.all_reduce``: under TP every rank then keeps the same positions)."""
    if policy == KNORM:
        total = knorm_scores(window.keys(layer)[0] for layer in range(window.num_layers))
    elif policy == SNAPKV_GLOBAL:
        from sgl_sparse.methods.eviction.base import observation_scores

        queries = {layer: q[-SNAPKV_WINDOW:] for layer, q in window.queries.items()}
        n_w = next(iter(queries.values())).shape[0]
        total = observation_scores(
            ObservationWindow(queries=queries, q_pos=window.q_pos[-n_w:], key_buffer=window.key_buffer,
                              key_rows=window.key_rows, k_pos=window.k_pos, num_layers=window.num_layers,
                              scale=window.scale),
            SNAPKV_KERNEL, SNAPKV_POOLING)
    else:
        raise ValueError(f"no scorer for policy {policy!r}")
    # Summed over the TP group in float64, as the route's scores (pool_scorer): every rank, and --tp-size 1, then
    # ranks near-ties alike.
    total = total.double().contiguous()
    return (total if window.all_reduce is None else window.all_reduce(total)).cpu()


def replay_scores(kept: torch.Tensor, ranges: Sequence[tuple[int, int]], inputs: ReplayInputs) -> torch.Tensor:
    """``kvzip_global``'s ``[n]`` scores (CPU float32, aligned with the retained positions ``kept``; 0 outside the
    ranges): the replays that reconstruct the ranges, run through ``inputs.run``. Raises :class:`PruneUnscored` when
    no replay fits ``inputs.max_tokens``."""
    from sgl_sparse.methods.eviction.kvzip import RangeScores, range_replays

    replays = range_replays(list(inputs.token_ids), kept, list(ranges), inputs.config, inputs.max_tokens)
    if not replays:
        raise PruneUnscored(f"{KVZIP_GLOBAL}: no room for a replay forward ({inputs.max_tokens} tokens: the row, the "
                            "model's context or the free and tree-evictable KV slots); nothing pruned")
    scorer = RangeScores(kept.numel(), inputs.config.sink_tokens)
    inputs.run(replays, scorer)
    return scorer.scores if inputs.max_over_ranks is None else inputs.max_over_ranks(scorer.scores)


def request_prune_leaves(kept: torch.Tensor, spec: PruneSpec, window: Callable[[], ObservationWindow],
                         replays: ReplayInputs | None = None) -> torch.Tensor:
    """Which of the retained positions ``kept`` (sorted, CPU) a request's own prune takes away (bool ``[n]``): those
    in its ranges, less the ``keep_tokens`` of them its policy scores highest (``window()`` builds the scoring view
    over ``kept``, ``replays`` runs ``kvzip_global``'s forwards; each only when that score is needed). No more of
    them retained than ``keep_tokens``: none leaves. Raises :class:`PruneUnscored` when a score cannot be had."""
    leave = in_ranges(kept, list(spec.ranges))
    n = int(leave.sum())
    if spec.keep_tokens <= 0 or n == 0:
        return leave
    if n <= spec.keep_tokens:
        return torch.zeros_like(leave)
    if spec.policy == KVZIP_GLOBAL:
        if replays is None:
            raise PruneUnscored(f"{KVZIP_GLOBAL}: this caller runs no replay forwards")
        scores = replay_scores(kept, spec.ranges, replays).double()
    else:
        scores = policy_scores(spec.policy, window())
    candidates = leave.nonzero().flatten()
    leave[select_keep(candidates, scores[candidates], spec.keep_tokens)] = False
    return leave


@dataclass(frozen=True)
class OwnPrune:
    """What a request's own prune decided: ``leave`` (bool over its retained positions: those that leave; ``None``
    when it could not score, then nothing leaves), ``report`` (for its response, ``meta_info["sgl_sparse"]["prune"]``)
    and ``evict_branches_after`` (for its finish: the first range's start when the spec asks to evict the idle
    branches, and something left)."""

    leave: torch.Tensor | None
    report: dict[str, Any]
    evict_branches_after: int | None = None

    @property
    def pruned(self) -> int:
        return 0 if self.leave is None else int(self.leave.sum())


def own_prune(kept: torch.Tensor, spec: PruneSpec, window: Callable[[], ObservationWindow],
              replays: ReplayInputs | None = None) -> OwnPrune:
    """A request's own prune over its retained positions ``kept`` (sorted, CPU): :func:`request_prune_leaves` and
    the report its response carries (``applied`` / ``nothing_to_prune``, or ``unscored`` with the reason, when a
    scored keep could not score: the prompt stays whole)."""
    in_n = int(in_ranges(kept, list(spec.ranges)).sum())
    try:
        leave = request_prune_leaves(kept, spec, window, replays)
    except PruneUnscored as e:
        return OwnPrune(None, {"status": "unscored", "policy": spec.policy, "pruned_tokens": 0, "kept_tokens": in_n,
                               "message": str(e)})
    pruned = int(leave.sum())
    report = {"status": "applied" if pruned else "nothing_to_prune", "policy": spec.policy,
              "pruned_tokens": pruned, "kept_tokens": in_n - pruned}
    after = spec.ranges[0][0] if pruned and spec.evict_branches else None
    return OwnPrune(leave, report, after)


def pool_scorer(kvcache: Any, policy: str, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``slots -> scores`` (CPU) of ``policy`` over the keys SGLang's KV pool ``kvcache`` holds at those slots, every
    layer, this rank's KV heads; ``all_reduce`` (``integration/tp.py``, ``None`` with one rank) sums them over the
    TP group, so every rank ranks the positions alike. A method-owned layout (a composition's quantized store) is
    read through its store, dequantized: the keys decode attention reads."""
    if policy != KNORM:
        raise ValueError(f"no scorer for policy {policy!r}")
    store = getattr(kvcache, "store", None)
    start = int(getattr(kvcache, "start_layer", 0) or 0)
    layers = range(start, start + int(kvcache.layer_num))

    def score(slots: torch.Tensor) -> torch.Tensor:
        slots = slots.long()
        keys = (store.read_keys(layer, slots) if store is not None else kvcache.get_key_buffer(layer)[slots]
                for layer in layers)
        s = knorm_scores(keys)
        if all_reduce is not None:
            s = all_reduce(s)
        return s.cpu()

    return score
