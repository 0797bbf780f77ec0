"""Decode attention over per-layer kept sets (PyramidKV's :class:`~sgl_sparse.methods.eviction.pyramidkv.
LayerKeepSelector`): at one layer, request row ``r`` reads the positions its set lists, ``keep[r, :count[r]]``
(ascending, all before ``tail[r]``), then every position from ``tail[r]`` up to its length (appended since the
selection), each through ``req_to_token``; none at or past the row's length (a CUDA-graph padding row, length 1,
reads at most its first position). A position holding the sentinel slot (evicted by an earlier selection,
or pruned) is skipped; a row with no set (``count`` 0, ``tail`` 0) reads every live position.

The list's length is ``count + max(seq_len - tail, 0)`` on the device, so one kernel launch with a grid fixed by
static shapes serves every batch: CUDA-graph safe, no host plan (FlashInfer's decode plans its lists' lengths on
the host, and the layers' lengths differ). Grid: request x KV head x ``splits`` (split-KV, as the quantized decode
kernels, ``kernels/splits.py``); the group's query heads are the rows of one tile. On the GPU the dots run in the
model dtype on the tensor cores with fp32 accumulation; under the interpreter in fp32.
:func:`decode_attention_torch` is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels.splits import (
    decode_splits,
    group_queries,
    merge_splits,
    softmax_step,
    split_bounds,
    split_workspace,
    store_split,
)
from sgl_sparse.slots import SENTINEL_SLOT


def list_positions(keep: torch.Tensor, count: int, tail: int, seq_len: int) -> torch.Tensor:
    """Row's positions at one layer (CPU int64): its set, then ``[tail, seq_len)``."""
    return torch.cat([keep[:count].long().cpu(), torch.arange(tail, max(seq_len, tail))])


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, keep: torch.Tensor,
                           count: torch.Tensor, tail: torch.Tensor, scale: float) -> torch.Tensor:
    """One request at a time (the reference, and the CPU server's path): ``q`` ``[bs, Hq, D]`` over each row's
    list at this layer (``keep`` ``[rows, W]``, ``count`` and ``tail`` ``[rows]``) -> ``[bs, Hq, Dv]``; a row
    that reads nothing gives 0."""
    bs, hq, _ = q.shape
    hkv = k_cache.shape[1]
    out = q.new_zeros(bs, hq, v_cache.shape[-1])
    for i in range(bs):
        row = int(req_pool_indices[i])
        n = int(seq_lens[i])
        pos = list_positions(keep[row], int(count[row]), int(tail[row]), n)
        pos = pos[pos < n]
        slots = req_to_token[row, pos.to(req_to_token.device)].long()
        slots = slots[slots != SENTINEL_SLOT]
        if slots.numel() == 0:
            continue
        k = k_cache[slots].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[slots].float().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v).to(q.dtype)
    return out


@triton.jit
def _decode_kernel(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, keep, count, tail, ws_m, ws_l,
                   ws_acc, stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t, stride_keep,
                   scale, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   BLOCK: tl.constexpr, NSPLIT: tl.constexpr, NATIVE: tl.constexpr):
    rh = tl.program_id(0)
    pid = tl.program_id(1)
    i = rh // HKV
    h = rh % HKV
    row = tl.load(req_pool_indices + i).to(tl.int64)
    c = tl.load(count + row)
    t = tl.load(tail + row)
    sl = tl.load(seq_lens + i)
    lo, hi = split_bounds(c + tl.maximum(sl - t, 0), pid, BLOCK, NSPLIT)
    d = tl.arange(0, D)
    qv = group_queries(q, i, h, stride_qb, stride_qh, G, GP, D)
    qv = qv.to(q.dtype.element_ty) if NATIVE else qv
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ok = j < hi
        in_set = j < c
        kept = tl.load(keep + row * stride_keep + j, mask=ok & in_set, other=0)
        pos = tl.where(in_set, kept, t + (j - c)).to(tl.int64)
        ok = ok & (pos < sl)
        slot = tl.load(req_to_token + row * stride_r2t + pos, mask=ok, other=0).to(tl.int64)
        ok = ok & (slot != 0)  # the sentinel slot (sgl_sparse.slots): an evicted or pruned position
        kb = tl.load(k_cache + slot[:, None] * stride_ks + h * stride_kh + d[None, :], mask=ok[:, None], other=0.0)
        vb = tl.load(v_cache + slot[:, None] * stride_vs + h * stride_vh + d[None, :], mask=ok[:, None], other=0.0)
        kb = kb if NATIVE else kb.to(tl.float32)
        vb = vb if NATIVE else vb.to(tl.float32)
        s = tl.dot(qv, tl.trans(kb)) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m, den, p, alpha = softmax_step(m, den, s)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
    store_split(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, D)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, keep: torch.Tensor, count: torch.Tensor,
                     tail: torch.Tensor, scale: float, splits: int | None = None, block: int | None = None,
                     warps: int | None = None) -> torch.Tensor:
    """:func:`decode_attention_torch` as one Triton kernel over the batch, then the splits' merge. No host sync:
    fixed shapes (``splits`` from the static width of ``keep`` by default), lengths read on the device.
    ``keep`` int32 ``[rows, W]`` contiguous in its last dim; ``count``, ``tail`` int32 ``[rows]``."""
    bs, hq, d = q.shape
    hkv = k_cache.shape[1]
    if bs == 0:
        return torch.empty_like(q)
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1 and q.stride(2) == 1 and keep.stride(1) == 1
    assert v_cache.shape[-1] == d, "the value head dim must equal the key's"
    g = hq // hkv
    if splits is None:
        splits = decode_splits(bs * hkv, keep.shape[1])
    ws_m, ws_l, ws_acc = split_workspace(bs * hkv, splits, g, d, q.device)
    _decode_kernel[(bs * hkv, splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, keep, count, tail, ws_m, ws_l, ws_acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), keep.stride(0), scale, HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d,
        BLOCK=block or (64 if q.is_cuda else 16), NSPLIT=splits, NATIVE=q.is_cuda, num_warps=warps or 4)
    return merge_splits(ws_m, ws_l, ws_acc, bs, q.dtype)
