"""The merge of split-KV partial softmax states (the decode kernels' second stage)."""

from __future__ import annotations

import torch


def merge_splits(ws_m: torch.Tensor, ws_l: torch.Tensor, ws_acc: torch.Tensor) -> torch.Tensor:
    """Partial states over ``splits`` (dim 1): running max ``ws_m`` and denominator ``ws_l``
    ``[rows, splits, G]``, unnormalized output ``ws_acc`` ``[rows, splits, G, D]`` -> ``[rows, G, D]``
    fp32. A split that read nothing (max ``-inf``) weighs 0; a row that read nothing gives 0."""
    top = ws_m.amax(dim=1, keepdim=True)
    w = torch.exp(ws_m - torch.where(top.isinf(), torch.zeros_like(top), top))
    den = (w * ws_l).sum(dim=1)
    return (w[..., None] * ws_acc).sum(dim=1) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
