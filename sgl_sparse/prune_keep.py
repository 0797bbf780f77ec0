"""The scored keep of Prefix-Cache Pruning (docs/prefix-cache-pruning.md): which ``keep_tokens`` of a prune's ranges
keep their KV. Pure torch (no SGLang import), tested against a plain reference; the server side
(``sgl_sparse/integration/prune_api.py``) reads the keys from SGLang's KV pool, sums the scores over the TP group
and hands them to the tree surgery (``sgl_sparse/radix/prune.py``).

What a prune has to score with: the pool's K and V of every resident position. The queries of the forward passes
that wrote them are gone, so SparseEngine's ``snapkv_global`` (attention of the sequence's last queries) and
``kvzip_global`` (attention while the model reconstructs the context) cannot be computed at prune time without
running the model again; neither is served. The policy served is query-agnostic:

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
serves two more policies:

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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import ObservationWindow
from sgl_sparse.rules import in_ranges

DROP, KNORM, SNAPKV_GLOBAL, KVZIP_GLOBAL = "drop", "knorm", "snapkv_global", "kvzip_global"
POLICIES = (DROP, KNORM)  # POST /v1/prefix_cache/prune: between batches, no queries
SCORED = (KNORM,)
# A request's own prune: its prompt's last queries exist, and replays can run in its step.
REQUEST_POLICIES = (DROP, KNORM, SNAPKV_GLOBAL, KVZIP_GLOBAL)
REQUEST_SCORED = (SNAPKV_GLOBAL, KNORM, KVZIP_GLOBAL)  # the first: the default when something is kept
# snapkv_global's window and pooling: SnapKV's defaults (its method's config, Li et al. 2024).
SNAPKV_WINDOW, SNAPKV_KERNEL, SNAPKV_POOLING = 32, 5, "avgpool"


class KeepError(ValueError):
    """A ``keep_tokens`` / ``keep_ratio`` / ``policy`` that cannot serve; ``field`` names the body field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class RangeError(ValueError):
    """A prune's ``ranges`` that cannot serve; ``field`` names the entry (``ranges`` or ``ranges[i]``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parse_ranges(value: Any, bound: int | None, bound_name: str) -> list[tuple[int, int]]:
    """``[[start, end], ...]`` of logical positions -> sorted, merged ``[start, end)`` pairs, ``0 <= start < end <=
    bound`` (``bound_name`` says what bounds them; no upper check when ``bound`` is ``None``). The one parser of the
    route's body and a request's own prune; raises :class:`RangeError` naming the entry."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise RangeError("ranges", "expected a non-empty list of [start, end] pairs")
    out = []
    for i, r in enumerate(value):
        if (not isinstance(r, Sequence) or isinstance(r, str) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise RangeError(f"ranges[{i}]", f"expected [start, end] integers, got {r!r}")
        lo, hi = r
        if not 0 <= lo < hi <= (hi if bound is None else bound):
            limit = "" if bound is None else f" <= {bound} ({bound_name})"
            raise RangeError(f"ranges[{i}]", f"[{lo}, {hi}) must satisfy 0 <= start < end{limit}")
        out.append((lo, hi))
    out.sort()
    merged = [out[0]]
    for lo, hi in out[1:]:
        if lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def parse_keep(body: Mapping[str, Any], size: int, page_size: int, policies: tuple[str, ...],
               scored: tuple[str, ...], hints: Mapping[str, str] | None = None) -> tuple[int, str]:
    """``keep_tokens`` / ``keep_ratio`` / ``policy`` of a prune body over ranges whose union holds ``size`` tokens
    -> ``(keep_tokens, policy)``. ``keep_ratio`` is taken over the union, rounded down to whole pages (SparseEngine's
    agent harness keeps a fraction of the tool tokens; with ``roles`` the client does not know the ranges' size).
    No policy: the first scored one when something is kept, else ``drop``. ``hints``: a sentence added to the error
    for a known policy name this caller does not serve. Raises :class:`KeepError`."""
    keep = body.get("keep_tokens", 0)
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise KeepError("keep_tokens", f"expected an integer >= 0, got {keep!r}")
    ratio = body.get("keep_ratio")
    if ratio is not None:
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 <= ratio < 1:
            raise KeepError("keep_ratio", f"expected a number in [0, 1), got {ratio!r}")
        if "keep_tokens" in body:
            raise KeepError("keep_ratio", "give keep_tokens or keep_ratio, not both")
        keep = int(ratio * size) // page_size * page_size
    policy = body.get("policy")
    if policy is None:
        policy = scored[0] if keep or ratio else DROP
    if policy not in policies:
        hint = (hints or {}).get(policy) if isinstance(policy, str) else None
        raise KeepError("policy", f"{policy!r}: expected one of {', '.join(policies)}" + (f" ({hint})" if hint else ""))
    if (keep or ratio) and policy not in scored:
        field = "keep_ratio" if ratio else "keep_tokens"
        raise KeepError(field, f"policy {policy!r} keeps nothing: give {field} 0, or a scored policy "
                               f"({', '.join(scored)})")
    if keep % page_size:
        raise KeepError("keep_tokens", f"{keep} is not a multiple of the page size {page_size} (a page is kept or "
                                       "dropped whole)")
    if keep and size and keep >= size:
        raise KeepError("keep_tokens", f"{keep} must be less than the ranges' size, {size} tokens (their union): "
                                       "keeping them all prunes nothing")
    return keep, policy


def parse_evict_branches(body: Mapping[str, Any]) -> bool:
    """A prune body's ``evict_branches`` (default false), as the route and a request's own prune take it. Raises
    :class:`KeepError` naming the field."""
    evict = body.get("evict_branches", False)
    if not isinstance(evict, bool):
        raise KeepError("evict_branches", f"expected true or false, got {evict!r}")
    return evict


@dataclass(frozen=True)
class PruneSpec:
    """A request's own prune: sorted, merged prompt ranges and, when ``keep_tokens`` > 0, how many of their
    retained positions stay and by which policy's score (the budget is over the union). ``evict_branches``: at the
    request's finish, first evict the idle cached branches hanging off its path after the first range (an agent's
    earlier replies as generated, beside their re-rendered history), as ``POST /v1/prefix_cache/prune`` does, so
    the pruned KV is freed rather than kept for them."""

    ranges: tuple[tuple[int, int], ...]
    keep_tokens: int = 0
    policy: str = DROP
    evict_branches: bool = False

    @property
    def scores(self) -> bool:
        """Whether the prune scores (it reads the pool's keys)."""
        return self.keep_tokens > 0 and self.policy in REQUEST_SCORED

    @property
    def needs_window(self) -> bool:
        """Whether its scores read an observation window (the prompt's last queries captured); kvzip_global's come
        from replay forwards instead."""
        return self.scores and self.policy != KVZIP_GLOBAL


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
    every head of the model (``window.reduce_heads``: under TP every rank then keeps the same positions)."""
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
