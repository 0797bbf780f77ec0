"""What a store that derives its layout from the model is handed (:meth:`KVStore.load_model`): each attention
layer's K/V projections and the rotary table the model applies to K. The runtime reads them from the loaded
model, this rank's shard, before the pool is built; a store that does not ask (``needs_model``) never sees them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionProjections:
    """One attention layer's K and V projections of this rank's KV heads: ``k_weight`` ``[Hkv * D, hidden]``,
    ``v_weight`` ``[Hkv * Dv, hidden]`` (rows head after head, as ``k = x @ k_weight.T`` lays them out), biases
    ``[Hkv * D]`` / ``[Hkv * Dv]`` or ``None``."""

    k_weight: torch.Tensor
    v_weight: torch.Tensor
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class RotaryTable:
    """The rotation the model applies to K before it is stored: at position ``p`` the first ``rotary_dim``
    dimensions of every head are rotated by the angles whose cosines and sines are ``cos_sin[p]``
    (``[max_positions, rotary_dim]``, fp32: the ``rotary_dim / 2`` cosines, then the sines; scaling variants
    such as Llama 3's are already in the table). ``neox``: pairs ``(i, i + rotary_dim / 2)`` (Llama, Qwen);
    else interleaved pairs ``(2i, 2i + 1)`` (GPT-J)."""

    cos_sin: torch.Tensor
    rotary_dim: int
    neox: bool = True


@dataclass(frozen=True)
class ModelKV:
    """Every attention layer's :class:`AttentionProjections` (layer order), this rank's KV heads and their
    dimensions, and the :class:`RotaryTable` (``None``: the model applies no rotation to K)."""

    layers: tuple[AttentionProjections, ...]
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rotary: RotaryTable | None
