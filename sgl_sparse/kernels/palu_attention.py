"""Palu's decode attention over low-rank latents (:class:`~sgl_sparse.methods.compression.palu.PaluStore`), one
Triton kernel over the batch: per tile of a row's tokens it reconstructs each key from its latent (``z @ B^T``),
rotates it at the token's stored position, scores it against the KV head's queries and accumulates the
probabilities times the *value latents* (online softmax, split over the row like the quantized stores' kernels).
The value basis is applied once per query head after the splits merge, not per token. No host sync, fixed shapes:
it runs inside SGLang's decode CUDA graph.

On the GPU the scores and the value accumulation run on the tensor cores in the model dtype (``NATIVE``): the
rotated key is rounded to it as a dense pool stores it, the probabilities as FlashInfer's decode rounds them; the
rotary table may be fp16 (half the bytes a position; its rounding is below the model dtype's). Under the
interpreter both run in fp32."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels.splits import (
    decode_splits,
    merge_splits,
    softmax_step,
    split_span,
    split_workspace,
    store_split,
)


@triton.jit
def _decode_kernel(q, zk, zv, pos_buf, bk, cos_sin, req_to_token, req_pool_indices, seq_lens, ws_m, ws_l, ws_acc,
                   stride_qb, stride_qh, stride_zks, stride_zkg, stride_zvs, stride_zvg, stride_bkg, stride_bkd,
                   stride_cs, stride_r2t, scale, HKV: tl.constexpr, GS: tl.constexpr, G: tl.constexpr,
                   GP: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr, RK: tl.constexpr,
                   RKP: tl.constexpr, RV: tl.constexpr, RVP: tl.constexpr, BLOCK: tl.constexpr,
                   NSPLIT: tl.constexpr, NATIVE: tl.constexpr, JC: tl.constexpr, I32: tl.constexpr,
                   ANGLES: tl.constexpr):
    rh, pid, i, h, _, lo, hi = split_span(seq_lens, HKV, BLOCK, NSPLIT)
    grp = h // GS
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    gi = tl.arange(0, GP)
    qrow = q + i * stride_qb + (h * G + gi)[:, None] * stride_qh
    dt = q.dtype.element_ty if NATIVE else tl.float32  # the dtype the score and value dots read
    rk = tl.arange(0, RKP)
    rv = tl.arange(0, RVP)
    base = bk + grp * stride_bkg + ((h % GS) * D).to(tl.int64) * stride_bkd
    idx = tl.int32 if I32 else tl.int64  # slot offsets: int32 when every offset into the pool fits
    zk_g = zk + grp * stride_zkg
    zv_g = zv + grp * stride_zvg
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, RVP], tl.float32)
    o = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        p = start + o
        ok = p < hi
        slot = tl.load(row_ptr + p, mask=ok, other=0).to(idx)
        z = tl.load(zk_g + slot[:, None] * stride_zks + rk[None, :], mask=ok[:, None] & (rk < RK)[None, :], other=0.0)
        tp = tl.load(pos_buf + slot, mask=ok, other=0).to(idx)
        # ANGLES: a tile whose positions run p0, p0 + 1, ... (every tile of a row nothing was evicted or pruned
        # from) takes its angles as p0's rotated by the table's first rows, cos((p0 + t)w) = cos(p0 w)cos(tw) -
        # sin(p0 w)sin(tw): one row gathered a tile instead of one a position
        if ANGLES:
            tp0 = tl.sum(tl.where(o == 0, tp, 0))
            contig = tl.sum(tl.where(ok & (tp != tp0 + o), 1, 0)) == 0
        else:
            tp0 = 0
            contig = False  # a compile-time False: the gather below, nothing computed for the test
        logits = tl.zeros([GP, BLOCK], tl.float32)
        # the head's frequencies JC at a time: fewer live [BLOCK, JC] tiles (registers) for the same work
        for c in tl.static_range(HALF // JC):
            j = c * JC + tl.arange(0, JC)
            # the two dimensions each rotation pair mixes: (j, j + D/2) (neox) or (2j, 2j + 1)
            d1 = j if NEOX else 2 * j
            d2 = j + HALF if NEOX else 2 * j + 1
            b1 = tl.load(base + d1[:, None] * stride_bkd + rk[None, :], mask=(rk < RK)[None, :], other=0.0)
            b2 = tl.load(base + d2[:, None] * stride_bkd + rk[None, :], mask=(rk < RK)[None, :], other=0.0)
            k1 = tl.dot(z.to(b1.dtype), tl.trans(b1))  # [BLOCK, JC] fp32: the pair's first dimension, before RoPE
            k2 = tl.dot(z.to(b2.dtype), tl.trans(b2))
            if contig:
                c0 = tl.load(cos_sin + tp0 * stride_cs + j).to(tl.float32)
                s0 = tl.load(cos_sin + tp0 * stride_cs + HALF + j).to(tl.float32)
                dcs = cos_sin + o[:, None] * stride_cs + j[None, :]
                ct = tl.load(dcs).to(tl.float32)
                st = tl.load(dcs + HALF).to(tl.float32)
                cos = c0[None, :] * ct - s0[None, :] * st
                sin = s0[None, :] * ct + c0[None, :] * st
            else:
                cs = cos_sin + tp[:, None] * stride_cs + j[None, :]
                cos = tl.load(cs, mask=ok[:, None], other=1.0).to(tl.float32)
                sin = tl.load(cs + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
            r1 = (k1 * cos - k2 * sin).to(dt)
            r2 = (k2 * cos + k1 * sin).to(dt)
            q1 = tl.load(qrow + d1[None, :], mask=(gi < G)[:, None], other=0.0).to(dt)
            q2 = tl.load(qrow + d2[None, :], mask=(gi < G)[:, None], other=0.0).to(dt)
            logits += tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))
        logits = tl.where(ok[None, :], logits * scale, float("-inf"))
        zvt = tl.load(zv_g + slot[:, None] * stride_zvs + rv[None, :], mask=ok[:, None] & (rv < RV)[None, :],
                      other=0.0)
        m, den, p, alpha = softmax_step(m, den, logits)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), zvt.to(dt))
    store_split(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, RVP)


INT32_LIMIT = 2**31


class Tile(NamedTuple):
    """A decode tile (:func:`decode_attention`'s arguments of the same names; 0: no register cap, all frequencies)."""

    block: int
    warps: int = 4
    stages: int = 3
    maxnreg: int = 0
    freq_chunk: int = 0
    query_rows: int = 16
    angles_by_tile: bool = False


# The GPU's tile by the rank padded to a power of two; benchmarks/quant_decode.py's sweeps chose them.
CUDA_TILES: dict[int, Tile] = {64: Tile(block=64), 128: Tile(block=32)}


def decode_attention(q: torch.Tensor, zk: torch.Tensor, zv: torch.Tensor, positions: torch.Tensor,
                     k_basis: torch.Tensor, v_basis: torch.Tensor, cos_sin: torch.Tensor, neox: bool,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     splits: int | None = None, block: int | None = None, warps: int | None = None,
                     stages: int | None = None, native: bool | None = None, maxnreg: int | None = None,
                     freq_chunk: int | None = None, query_rows: int | None = None,
                     angles_by_tile: bool | None = None) -> torch.Tensor:
    """Decode attention over one layer's latents: ``q`` ``[bs, Hq, D]``; ``zk``/``zv`` ``[slots, groups, r]``,
    ``positions`` ``[slots]`` int32; ``k_basis``/``v_basis`` ``[groups, group_size * D, r]``; ``cos_sin`` the
    rotary table ``[max_pos, D]`` (the whole head rotated; fp32 or fp16) -> ``[bs, Hq, D]`` in ``q``'s dtype.
    ``block`` (positions an iteration), ``warps``, ``stages``, ``maxnreg`` (registers a thread at most: more blocks
    an SM), ``freq_chunk`` (rotary frequencies reconstructed at a time, a power of two >= 16 dividing ``D / 2``:
    fewer live registers for the same work), ``query_rows`` (the group's query heads padded to this power of two;
    default 16, the tensor cores' rows), ``angles_by_tile`` (a tile of consecutive positions rotates its first
    position's angles instead of gathering one table row a position): the tile, for benchmarks/quant_decode.py's
    sweeps;
    ``native``: dots in the model dtype (default: on the GPU)."""
    bs, hq, d = q.shape
    groups, gd, rk = k_basis.shape
    gs = gd // d
    hkv, rv = groups * gs, v_basis.shape[2]
    if bs == 0:
        return torch.empty_like(q)
    assert d & (d - 1) == 0 and cos_sin.shape[1] == d, "a power-of-two head dim, every dimension rotated"
    assert q.stride(2) == 1 and zk.stride(2) == 1 and zv.stride(2) == 1 and k_basis.stride(2) == 1
    half = d // 2
    rkp = triton.next_power_of_2(rk)
    if q.is_cuda:
        t = CUDA_TILES.get(rkp, CUDA_TILES[max(CUDA_TILES)])
        block, warps, stages = block or t.block, warps or t.warps, stages or t.stages
        maxnreg, freq_chunk, query_rows = maxnreg or t.maxnreg, freq_chunk or t.freq_chunk, query_rows or t.query_rows
        angles_by_tile = t.angles_by_tile if angles_by_tile is None else angles_by_tile
    block = block or 16
    assert not angles_by_tile or cos_sin.shape[0] >= block, "angles by tile read the table's first rows"
    jc = freq_chunk or half
    assert jc >= 16 and half % jc == 0 and jc & (jc - 1) == 0, f"freq_chunk {jc}: a power of two >= 16 dividing {half}"
    g = hq // hkv
    rvp = triton.next_power_of_2(rv)
    if splits is None:
        splits = decode_splits(bs * hkv, req_to_token.shape[1])
    ws_m, ws_l, ws_acc = split_workspace(bs * hkv, splits, g, rvp, q.device)
    # every offset a program computes from a slot or a position lies inside one of these tensors
    i32 = max(zk.numel(), zv.numel(), cos_sin.numel(), positions.numel()) < INT32_LIMIT
    _decode_kernel[(bs * hkv, splits)](
        q, zk, zv, positions, k_basis, cos_sin, req_to_token, req_pool_indices, seq_lens, ws_m, ws_l, ws_acc,
        q.stride(0), q.stride(1), zk.stride(0), zk.stride(1), zv.stride(0), zv.stride(1), k_basis.stride(0),
        k_basis.stride(1), cos_sin.stride(0), req_to_token.stride(0), scale, HKV=hkv, GS=gs, G=g,
        GP=max(query_rows or 16, triton.next_power_of_2(g)), D=d, HALF=half, NEOX=neox, RK=rk, RKP=rkp, RV=rv,
        RVP=rvp, BLOCK=block, NSPLIT=splits,
        NATIVE=q.is_cuda if native is None else native, JC=jc, I32=i32, ANGLES=bool(angles_by_tile),
        num_warps=warps or 4,
        **({"num_stages": stages} if stages else {}), **({"maxnreg": maxnreg} if maxnreg else {}))
    lat = merge_splits(ws_m, ws_l, ws_acc)[..., :rv].reshape(bs, groups, gs, g, rv)
    vb = v_basis.view(groups, gs, d, rv).to(torch.float32)
    return torch.einsum("bxsgr,xsdr->bxsgd", lat, vb).reshape(bs, hq, d).to(q.dtype)
