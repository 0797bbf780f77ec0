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

Ties go to the earlier position.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

DROP, KNORM = "drop", "knorm"
POLICIES = (DROP, KNORM)
SCORED = (KNORM,)


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
