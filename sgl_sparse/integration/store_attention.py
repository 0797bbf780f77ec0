"""Attention over a method-owned KV layout (:class:`sgl_sparse.contract.KVStore`), for every base.

* Decode: the store encodes this step's K/V (:meth:`~sgl_sparse.contract.KVStore.write`, with each
  token's row), then its :meth:`~sgl_sparse.contract.KVStore.decode` reads each row through
  ``req_to_token`` (device only: CUDA-graph safe).
* Extend: the new tokens attend to each other at full precision (causal; FlashInfer's ragged prefill on
  the GPU, plain torch on CPU), their queries attend to the cached prefix through the store's
  :meth:`~sgl_sparse.contract.KVStore.prefix`, and the two parts are merged by their log-sum-exp, as
  SGLang's own ragged + paged extend does; then the new K/V is stored. The rows' offsets and each new
  token's row are computed once per forward (sizes from the host: no sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import KVStore

LN2 = math.log(2.0)


@dataclass
class ExtendLists:
    """An extend step's rows: new tokens per row (``qo_indptr``, device; ``extend_lens``, host), cached
    prefix lengths (device), and each new token's row (``rows``, its ``req_pool_idx``, for the write)."""

    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    rows: torch.Tensor
    extend_lens: list[int]
    has_prefix: bool


def extend_lists(forward_batch: Any, req_to_token: torch.Tensor) -> ExtendLists:
    device = req_to_token.device
    extend_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    bs = len(extend_lens)
    seq = forward_batch.extend_seq_lens.to(torch.int64)
    qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    qo_indptr[1:] = torch.cumsum(seq, 0)
    rows = torch.repeat_interleave(forward_batch.req_pool_indices.to(torch.int64), seq, output_size=sum(extend_lens))
    return ExtendLists(qo_indptr, forward_batch.extend_prefix_lens.to(torch.int32), rows, extend_lens,
                       any(int(n) > 0 for n in forward_batch.extend_prefix_lens_cpu))


def causal_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extend_lens: list[int],
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's new tokens over themselves, causal, fp32: (output ``[n, Hq, D]``, natural lse ``[n, Hq]``)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    at = 0
    for n in extend_lens:
        qs, ks, vs = q[at:at + n].float(), k[at:at + n].float(), v[at:at + n].float()
        logits = torch.einsum("thd,shd->hts", qs, ks.repeat_interleave(group, dim=1)) * scale
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
        lse[at:at + n] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        out[at:at + n] = torch.einsum("hts,shd->thd", torch.softmax(logits, dim=-1),
                                      vs.repeat_interleave(group, dim=1)).to(q.dtype)
        at += n
    return out, lse


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Two attention parts over disjoint keys -> their joint softmax (``lse`` natural, ``-inf`` = empty part)."""
    top = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - top)[..., None]
    w2 = torch.exp(lse2 - top)[..., None]
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(o1.dtype)


def check_layer(layer: Any, store: KVStore) -> None:
    if getattr(layer, "is_cross_attention", False) or getattr(layer, "sliding_window_size", -1) not in (None, -1):
        raise ValueError(f"sgl_sparse: {type(store).__name__} serves full causal self-attention only (no cross "
                         "attention or sliding windows)")
    if str(getattr(layer, "attn_type", "")).endswith("ENCODER_ONLY"):
        raise ValueError(f"sgl_sparse: {type(store).__name__} serves causal decoders only (encoder-only layer)")
    if getattr(layer, "logit_cap", 0) not in (None, 0, 0.0):
        raise ValueError(f"sgl_sparse: {type(store).__name__} does not apply logit soft-capping")
    if getattr(layer, "k_scale_float", None) not in (None, 1.0) or getattr(layer, "v_scale_float", None) not in (
            None, 1.0):
        raise ValueError(f"sgl_sparse: checkpoint KV scales are not supported with {type(store).__name__} (its "
                         "scales are its own)")


def store_extend(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                 lists: ExtendLists, save_kv_cache: bool, new_tokens: Any, merge_fn: Any = merge) -> torch.Tensor:
    """One layer's extend attention over ``backend``'s store pool; ``new_tokens(q3, k3, v3, layer, lists)`` is
    the base's causal attention of the new tokens (output, natural lse), ``merge_fn`` its merge of two parts."""
    store: KVStore = backend.token_to_kv_pool.store
    check_layer(layer, store)
    hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
    q3 = q.reshape(-1, hq, d).contiguous()
    k3, v3 = k.reshape(-1, hkv, d).contiguous(), v.reshape(-1, hkv, layer.v_head_dim).contiguous()
    o, lse = new_tokens(q3, k3, v3, layer, lists)
    if lists.has_prefix:
        o2, lse2 = store.prefix(layer.layer_id, q3, lists.qo_indptr, backend.req_to_token_pool.req_to_token,
                                forward_batch.req_pool_indices, lists.prefix_lens, lists.extend_lens,
                                float(layer.scaling))
        o = merge_fn(o, lse, o2, lse2)
    if save_kv_cache:
        store.write(layer.layer_id, forward_batch.out_cache_loc, k3, v3, lists.rows, decode=False)
    return o.reshape(-1, hq * layer.v_head_dim)


def store_decode(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                 save_kv_cache: bool) -> torch.Tensor:
    store: KVStore = backend.token_to_kv_pool.store
    check_layer(layer, store)
    hq, d = layer.tp_q_head_num, layer.qk_head_dim
    if save_kv_cache and k is not None:
        store.write(layer.layer_id, forward_batch.out_cache_loc, k.reshape(-1, layer.tp_k_head_num, d),
                    v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim), forward_batch.req_pool_indices, decode=True)
    q3 = q.reshape(-1, hq, d)
    o = store.decode(layer.layer_id, q3, backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                     forward_batch.seq_lens, float(layer.scaling))
    return o.reshape(-1, hq * layer.v_head_dim)
