"""Shared logic of the eviction family: budgeted selection over the retained positions."""

from __future__ import annotations

import torch


def sink_recent_keep(kept: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """The first ``sink`` and last ``recent`` retained positions (StreamingLLM's attention sink)."""
    if kept.numel() <= sink + recent:
        return kept
    return torch.cat([kept[:sink], kept[kept.numel() - recent:]])


def topk_keep(kept: torch.Tensor, scores: torch.Tensor, budget: int, sink: int, window: int) -> torch.Tensor:
    """Keep ``budget`` of the retained positions ``kept`` (sorted): the first ``sink``, the last
    ``window``, and the highest ``scores`` (aligned with ``kept``) among the rest. Ties go to the
    earlier position (``torch.topk`` on CPU is not stable, so the order is made explicit)."""
    n = kept.numel()
    if n <= budget:
        return kept
    lo, hi = min(sink, n), max(n - window, min(sink, n))
    middle = scores[lo:hi].float().cpu()
    take = budget - lo - (n - hi)
    if take <= 0:
        chosen = torch.empty(0, dtype=torch.long)
    else:
        # Stable: sort by (-score, index).
        order = torch.argsort(-middle, stable=True)[:take]
        chosen = order.sort().values + lo
    idx = torch.cat([torch.arange(lo), chosen, torch.arange(hi, n)])
    return kept[idx]
