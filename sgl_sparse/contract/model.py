"""What a store that derives its layout from the model is handed (:meth:`KVStore.load_model`): each attention
layer's K/V projections, the rotary table the model applies to K, and a way to the second moments of the K/V it
computes on calibration text (:class:`KVMoments`). The runtime reads them from the loaded
model, this rank's shard, before the pool is built; a store that does not ask (``needs_model``) never sees them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
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


def head_digests(weight: torch.Tensor, head_dim: int) -> list[str]:
    """One digest per head of a K or V projection (``[heads * head_dim, hidden]``), over its rows in bf16 (a model
    loaded as bf16 or fp32 from a bf16 checkpoint gives the same digest)."""
    rows = weight.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16)
    return [hashlib.sha256(rows[h * head_dim:(h + 1) * head_dim].numpy().tobytes()).hexdigest()[:24]
            for h in range(weight.shape[0] // head_dim)]


@dataclass
class KVMoments:
    """Per layer: ``k[l]``/``v[l]`` ``[H * D, H * D]`` fp64, the second moment of the layer's pre-rotary K (V) over
    every KV head ``H`` of the model (the ridge included), and ``k_heads[l]``/``v_heads[l]`` the heads' digests
    (:func:`head_digests`). ``source``/``tokens``: the calibration text and how many tokens were read."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_heads: list[list[str]]
    v_heads: list[list[str]]
    head_dim: int
    source: str
    tokens: int

    def for_heads(self, layer: int, k_weight: torch.Tensor,
                  v_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments of the heads ``k_weight``/``v_weight`` (a rank's shard) hold, found by digest; ``ValueError``
        when a head is not among the calibrated weights'."""
        out = []
        for moments, digests, w in ((self.k, self.k_heads, k_weight), (self.v, self.v_heads, v_weight)):
            idx = []
            for h, d in enumerate(head_digests(w, self.head_dim)):
                if d not in digests[layer]:
                    raise ValueError(f"layer {layer}'s KV head {h} is not among the calibrated weights' (the "
                                     "moments were computed for another checkpoint)")
                idx.append(digests[layer].index(d))
            dims = torch.cat([torch.arange(i * self.head_dim, (i + 1) * self.head_dim) for i in idx])
            out.append(moments[layer][dims][:, dims])
        return out[0], out[1]


@dataclass(frozen=True)
class ModelKV:
    """Every attention layer's :class:`AttentionProjections` (layer order), this rank's KV heads and their
    dimensions, the :class:`RotaryTable` (``None``: the model applies no rotation to K), and ``calibrate``."""

    layers: tuple[AttentionProjections, ...]
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rotary: RotaryTable | None
    # calibrate(source, tokens): the moments of the model's K/V over calibration text (``"synthetic"`` or a file),
    # loaded from the cache or computed; None where the runtime cannot compute them (TP > 1)
    calibrate: Callable[[str, int], KVMoments] | None = None
