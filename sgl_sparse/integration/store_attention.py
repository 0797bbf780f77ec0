"""Attention over a method-owned KV layout (:class:`sgl_sparse.contract.KVStore`), for every base.

* Decode: this step's K/V goes through the pool's ``set_kv_buffer`` (the store encodes it), then the
  store's :meth:`~sgl_sparse.contract.KVStore.decode` reads each row through ``req_to_token`` (device
  only: CUDA-graph safe).
* Extend: the new tokens attend to each other at full precision (causal; FlashInfer's ragged prefill on
  the GPU, plain torch on CPU), their queries attend to the cached prefix through the store's
  :meth:`~sgl_sparse.contract.KVStore.prefix`, and the two parts are merged by their log-sum-exp, as
  SGLang's own ragged + paged extend does; then the new K/V is stored. The prefix lists are built once
  per forward from ``req_to_token`` with the host's prefix lengths (no sync).
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
    """An extend step's rows: new tokens per row (``qo_indptr``, device; ``extend_lens``, host) and the
    cached prefix's slots (``kv_indptr``/``kv_indices``, device)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    extend_lens: list[int]
    has_prefix: bool


def extend_lists(forward_batch: Any, req_to_token: torch.Tensor) -> ExtendLists:
    device = req_to_token.device
    extend_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    prefix_cpu = [int(n) for n in forward_batch.extend_prefix_lens_cpu]
    bs = len(extend_lens)
    total = sum(prefix_cpu)
    prefix = forward_batch.extend_prefix_lens.to(torch.int64)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(prefix, 0)
    qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    qo_indptr[1:] = torch.cumsum(forward_batch.extend_seq_lens.to(torch.int64), 0)
    # Slot j of the flat list: row r = the request it falls in, offset j - kv_indptr[r] (sizes from the host).
    rows = torch.repeat_interleave(torch.arange(bs, device=device), prefix, output_size=total)
    offs = torch.arange(total, device=device) - kv_indptr[rows].to(torch.int64)
    kv_indices = req_to_token[forward_batch.req_pool_indices[rows].to(torch.int64), offs].to(torch.int32)
    return ExtendLists(qo_indptr, kv_indptr, kv_indices, extend_lens, total > 0)


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
    if getattr(layer, "logit_cap", 0) not in (None, 0, 0.0):
        raise ValueError(f"sgl_sparse: {type(store).__name__} does not apply logit soft-capping")


def store_extend(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                 lists: ExtendLists, save_kv_cache: bool, new_tokens: Any) -> torch.Tensor:
    """One layer's extend attention over ``backend``'s store pool; ``new_tokens(q3, k3, v3, layer, lists)`` is
    the base's causal attention of the new tokens (output, natural lse)."""
    store: KVStore = backend.token_to_kv_pool.store
    check_layer(layer, store)
    hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
    q3 = q.reshape(-1, hq, d)
    k3, v3 = k.reshape(-1, hkv, d), v.reshape(-1, hkv, layer.v_head_dim)
    o, lse = new_tokens(q3, k3, v3, layer, lists)
    if lists.has_prefix:
        o2, lse2 = store.prefix(layer.layer_id, q3, lists.qo_indptr, lists.kv_indptr, lists.kv_indices,
                                float(layer.scaling), lists.extend_lens)
        o = merge(o, lse, o2, lse2)
    if save_kv_cache:
        backend.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k3, v3)
    return o.reshape(-1, hq * layer.v_head_dim)


def store_decode(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                 save_kv_cache: bool) -> torch.Tensor:
    store: KVStore = backend.token_to_kv_pool.store
    check_layer(layer, store)
    hq, d = layer.tp_q_head_num, layer.qk_head_dim
    if save_kv_cache and k is not None:
        backend.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
    q3 = q.reshape(-1, hq, d)
    o = store.decode(layer.layer_id, q3, backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                     forward_batch.seq_lens, float(layer.scaling))
    return o.reshape(-1, hq * layer.v_head_dim)
