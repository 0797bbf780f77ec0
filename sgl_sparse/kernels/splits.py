"""Split-KV decode pieces shared by the decode kernels: the online-softmax step and the splits' merge."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def online_step(m, lse_sum, acc, logits, vals):
    """One online-softmax step: ``logits`` ``[G, N]``, ``vals`` ``[N, D]`` (fp32)."""
    m_new = tl.maximum(m, tl.max(logits, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p, vals)
    return m_new, lse_sum * alpha + tl.sum(p, 1), acc


def merge_splits(ws_m: torch.Tensor, ws_l: torch.Tensor, ws_acc: torch.Tensor) -> torch.Tensor:
    """Partial states over ``splits`` (dim 1): running max ``ws_m`` and denominator ``ws_l``
    ``[rows, splits, G]``, unnormalized output ``ws_acc`` ``[rows, splits, G, D]`` -> ``[rows, G, D]``
    fp32. A split that read nothing (max ``-inf``) weighs 0; a row that read nothing gives 0."""
    top = ws_m.amax(dim=1, keepdim=True)
    w = torch.exp(ws_m - torch.where(top.isinf(), torch.zeros_like(top), top))
    den = (w * ws_l).sum(dim=1)
    return (w[..., None] * ws_acc).sum(dim=1) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
