"""Rotary position embedding applied or undone from a model's cos/sin table (:class:`~sgl_sparse.contract.RotaryTable`
layout): the plain-torch form a layout of pre-rotary K (Palu's) stores through and reads back with."""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int, neox: bool, inverse: bool = False) -> torch.Tensor:
    """``x`` ``[n, H, D]`` rotated at each row's angles ``cos_sin`` ``[n, rotary_dim]`` (cosines, then sines), in
    fp32; ``inverse`` rotates back (the rotation's transpose: a rotation is undone exactly up to rounding). The
    dimensions past ``rotary_dim`` pass through."""
    x = x.float()
    half = rotary_dim // 2
    cos = cos_sin[:, None, :half].float()
    sin = cos_sin[:, None, half:rotary_dim].float()
    if inverse:
        sin = -sin
    rot = x[..., :rotary_dim]
    if neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rotary_dim:]], dim=-1)
