"""The loaded model's K/V projections and rotary table, for a store whose layout derives from them
(:class:`~sgl_sparse.contract.ModelKV`, ``KVStore.needs_model``): read from SGLang's attention modules of this
rank's layers before the pool is built (``integration/kv_pool.py``)."""

from __future__ import annotations

from typing import Any

import torch

from sgl_sparse.contract import AttentionProjections, ModelKV, RotaryTable
from sgl_sparse.contract.model import head_digests

# Rotary classes whose table is a pure rotation per position (cos/sin of some frequencies, no magnitude scale as
# YaRN's mscale, one position per token as not M-RoPE's): undone exactly by the transposed rotation.
PLAIN_ROTARY = ("RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding",
                "DynamicNTKScalingRotaryEmbedding", "DynamicNTKAlphaRotaryEmbedding")
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def _layers(model: Any) -> list[Any]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"sgl_sparse: {type(model).__name__} has no model.layers to read K/V projections from")
    return list(layers)


def _attention(layer: Any, i: int) -> Any:
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(hasattr(attn, a) for a in ("qkv_proj", "q_size", "kv_size", "head_dim")):
        raise ValueError(f"sgl_sparse: layer {i}'s attention ({type(attn).__name__}) is not a fused-QKV attention "
                         "whose K/V projections the layout can read (Llama-style models)")
    return attn


def _rotary(attn: Any, context_len: int) -> RotaryTable:
    rope: Any = attn.rotary_emb
    name = type(rope).__name__
    if name not in PLAIN_ROTARY:
        raise ValueError(f"sgl_sparse: the model's rotary embedding {name} is not a plain rotation per position "
                         f"(served: {', '.join(PLAIN_ROTARY)}), which a layout of pre-rotary K must undo")
    if int(rope.cos_sin_cache.shape[0]) < context_len:
        rope._ensure_cos_sin_cache_length(context_len)
    return RotaryTable(rope.cos_sin_cache.detach().float().clone(), int(rope.rotary_dim), bool(rope.is_neox_style))


def _calibrate(model_path: str, layers: list[AttentionProjections], head_dim: int) -> Any:
    """``ModelKV.calibrate`` of a whole model (one rank): its moments from the cache, else computed there. The
    weights are hashed only when a store asks (a server without calibration never reads them back to the host)."""
    from sgl_sparse import prepare

    def calibrate(source: str, tokens: int) -> Any:
        k_heads = [head_digests(p.k_weight, head_dim) for p in layers]
        v_heads = [head_digests(p.v_weight, head_dim) for p in layers]
        return prepare.load_or_compute(k_heads, v_heads, model_path, source, tokens)

    return calibrate


def model_kv(model: Any, start_layer: int, end_layer: int, context_len: int, model_path: str,
             whole_model: bool) -> ModelKV:
    """This rank's layers ``[start_layer, end_layer)`` of ``model`` as :class:`ModelKV`; ``ValueError`` naming
    what a layout derived from them cannot read (quantized weights, another attention or rotary).
    ``whole_model``: this rank holds every layer and head (calibration is served only then)."""
    projections, rotary, dims = [], None, None
    for i, layer in enumerate(_layers(model)[start_layer:end_layer], start=start_layer):
        attn = _attention(layer, i)
        qkv = attn.qkv_proj
        w = getattr(qkv, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dtype not in _FLOAT:
            raise ValueError(f"sgl_sparse: layer {i}'s QKV weights are not a plain float matrix (a quantized "
                             "checkpoint); a layout derived from K/V projections needs them unquantized")
        q, kv = int(attn.q_size), int(attn.kv_size)
        v_dim = int(getattr(attn, "v_head_dim", attn.head_dim))
        heads = kv // int(attn.head_dim)
        dims = (heads, int(attn.head_dim), v_dim)
        b = getattr(qkv, "bias", None)
        projections.append(AttentionProjections(
            k_weight=w[q:q + kv].detach(), v_weight=w[q + kv:q + kv + heads * v_dim].detach(),
            k_bias=None if b is None else b[q:q + kv].detach(),
            v_bias=None if b is None else b[q + kv:q + kv + heads * v_dim].detach()))
        if rotary is None and getattr(attn, "rotary_emb", None) is not None:
            rotary = _rotary(attn, context_len)
    if dims is None:
        raise ValueError("sgl_sparse: this rank holds no attention layers")
    calibrate = _calibrate(model_path, projections, dims[1]) if whole_model else None
    return ModelKV(tuple(projections), num_kv_heads=dims[0], head_dim=dims[1], v_head_dim=dims[2], rotary=rotary,
                   calibrate=calibrate)
