"""Decode and extend attention over KIVI's layout (``methods/quantization/kivi.py``), dequantized in registers.

Not served on CUDA without the launcher's opt-in until these kernels have run on a GPU. Layout, per
layer: K and V codes ``[slots, Hkv, bits, D / 8]`` uint8 bit planes (plane ``b`` holds bit ``b`` of 8
channels a byte, the first channel in the lowest bit); K scale and zero ``[pages, Hkv, D]`` (one page
= one key group), V scale and zero ``[slots, Hkv, D / G]``, fp16; the residual ``[rows, G, Hkv, D]``
holds each request's positions past its last whole page, in the model dtype.

Decode grid: request x KV head x ``splits`` (``splits.decode_splits``: more for wide rows and small batches),
merged in torch. Each program walks whole pages of its row (the pool's page size is the group size), a page
an iteration: one ``req_to_token`` read gives the page's ``G`` contiguous slots, its key scale and zero are read
once as ``[D]`` vectors, each code plane as ``[G, D / 8]`` bytes; the row's open page (the residual) is read once,
by the last split. The first version walked 16 positions at a time and read per position a slot, the page's key
scale and zero as ``[16, D]`` gathers (32-fold redundant), every code byte 8 times and a masked residual tile:
~27 ms a layer at 6 x 130K on the H200 (6.9 tok/s, 2026-12-03), against ~0.25 ms to read the 4-bit pool.
Extend (:func:`prefix_attention`): the step's cached prefixes are first dequantized once into a workspace in
the model dtype (``[prefix tokens, Hkv, D]`` for K and V, at most ``WS_TOKENS`` prefix tokens at a time: a
130K prefix takes 0.5 GB a layer), then blocks of ``BLOCK_M`` new tokens of one request x KV head (the
group's query heads as rows of one tile) attend over it with the tensor cores in that dtype; output and
natural log-sum-exp, merged by the caller with the new tokens' own attention. Why a workspace: an extend
tile that dequantized the prefix itself (the first version) did so once per block of new tokens, i.e.
1,024 times for a 16K chunk, and ran at ~4 TFLOP/s on the H200 (a 130K prompt took minutes to prefill,
BENCHMARKS.md 2026-12-03); the workspace dequantizes each prefix token once per layer and chunk. The
store's torch path is the reference of both kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels import fp8_attention
from sgl_sparse.kernels.splits import (
    decode_splits,
    extend_rows,
    group_queries,
    merge_splits,
    online_step,
    online_step_weighted,
    pass_starts,
    prefix_passes,
    split_workspace,
    store_rows,
    store_split,
    unpack_planes,
    workspace_span,
)

WS_TOKENS = 1 << 18  # prefix tokens dequantized per pass (K and V: 1 GB at 8 KV heads x 128 in bf16)
DEQUANT_BLOCK = 64


@triton.jit
def _kv_block(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, row_ptr, row, h, pos, ok, whole,
              stride_cs, stride_ch, stride_ksp, stride_ksh, stride_vss, stride_vsh, stride_rr, stride_rt, stride_rh,
              BLOCK: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr):
    """K and V ``[BLOCK, D]`` (fp32) of a row's positions ``pos``: dequantized codes below ``whole``, the
    residual from there."""
    d = tl.arange(0, D)
    quant = ok & (pos < whole)
    res = ok & (pos >= whole)
    slot = tl.load(row_ptr + pos, mask=quant, other=0).to(tl.int64)
    page = slot // GS
    kso = page[:, None] * stride_ksp + h * stride_ksh + d[None, :]
    ks = tl.load(k_scale + kso, mask=quant[:, None], other=0.0).to(tl.float32)
    kz = tl.load(k_zero + kso, mask=quant[:, None], other=0.0).to(tl.float32)
    vso = slot[:, None] * stride_vss + h * stride_vsh + (d // GS)[None, :]
    vs = tl.load(v_scale + vso, mask=quant[:, None], other=0.0).to(tl.float32)
    vz = tl.load(v_zero + vso, mask=quant[:, None], other=0.0).to(tl.float32)
    kq = unpack_planes(k_codes, slot, h, stride_cs, stride_ch, quant, BLOCK, BITS, D).to(tl.float32) * ks + kz
    vq = unpack_planes(v_codes, slot, h, stride_cs, stride_ch, quant, BLOCK, BITS, D).to(tl.float32) * vs + vz
    roff = row * stride_rr + (pos - whole).to(tl.int64)[:, None] * stride_rt + h * stride_rh + d[None, :]
    kr = tl.load(res_k + roff, mask=res[:, None], other=0.0).to(tl.float32)
    vr = tl.load(res_v + roff, mask=res[:, None], other=0.0).to(tl.float32)
    return tl.where(res[:, None], kr, kq), tl.where(res[:, None], vr, vq)


@triton.jit
def _dequant_kernel(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token, req_pool_indices,
                    prefix_lens, ws_start, wk, wv, stride_cs, stride_ch, stride_ksp, stride_ksh, stride_vss,
                    stride_vsh, stride_rr, stride_rt, stride_rh, stride_r2t, stride_wt, stride_wh, D: tl.constexpr,
                    GS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Request ``program_id(0)``'s cached prefix, KV head ``program_id(1)``, positions of block ``program_id(2)``:
    dequantized into the workspace from row ``ws_start[i]`` (``-1``: not in this pass)."""
    i, h, n, base, pos, ok = workspace_span(prefix_lens, ws_start, BLOCK)
    whole = n // GS * GS
    row = tl.load(req_pool_indices + i).to(tl.int64)
    row_ptr = req_to_token + row * stride_r2t
    kk, vv = _kv_block(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, row_ptr, row, h, pos, ok,
                       whole, stride_cs, stride_ch, stride_ksp, stride_ksh, stride_vss, stride_vsh, stride_rr,
                       stride_rt, stride_rh, BLOCK, D, GS, BITS)
    d = tl.arange(0, D)
    off = (base + pos.to(tl.int64))[:, None] * stride_wt + h * stride_wh + d[None, :]
    tl.store(wk + off, kk.to(wk.dtype.element_ty), mask=ok[:, None])
    tl.store(wv + off, vv.to(wv.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _prefix_kernel(q, wk, wv, qo_indptr, prefix_lens, ws_start, blk_req, blk_start, out, lse, stride_qt, stride_qh,
                   stride_ot, stride_oh, stride_wt, stride_wh, scale, HQ: tl.constexpr, G: tl.constexpr,
                   GP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    i, tok, head, rm, qv = extend_rows(q, qo_indptr, blk_req, blk_start, stride_qt, stride_qh, G, GP, D, BLOCK_M)
    h = tl.program_id(1)
    n = tl.load(prefix_lens + i)
    base = tl.load(ws_start + i).to(tl.int64)
    d = tl.arange(0, D)
    m = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, D], tl.float32)
    for start in range(0, n, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < n
        off = (base + pos.to(tl.int64))[:, None] * stride_wt + h * stride_wh + d[None, :]
        kk = tl.load(wk + off, mask=ok[:, None], other=0.0)
        vv = tl.load(wv + off, mask=ok[:, None], other=0.0)
        s = tl.dot(qv, tl.trans(kk)) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m, den, acc = online_step_weighted(m, den, acc, s, vv, tl.full([BLOCK_N], 1.0, tl.float32))
    store_rows(out, lse, tok, head, rm, m, den, acc, stride_ot, stride_oh, HQ, D)


@triton.jit
def _page_codes(codes, slot, h, stride_cs, stride_ch, ok, BLOCK: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr):
    """int32 codes ``[BLOCK, D]`` of ``slot`` x channel, KV head ``h``: each plane read once as ``[BLOCK, D / 8]``
    bytes (contiguous per slot, so vector loads; :func:`unpack_planes` gathers every byte 8 times, once per
    channel), its 8 bits spread on a new last axis and folded into channels by a reshape (channel ``8 j + t``
    is bit ``t`` of byte ``j``, so the row-major reshape of ``[BLOCK, D / 8, 8]`` is the channel order)."""
    j = tl.arange(0, D // 8)
    t = tl.arange(0, 8)
    base = codes + slot[:, None] * stride_cs + h * stride_ch + j[None, :]
    val = tl.zeros([BLOCK, D // 8, 8], tl.int32)
    for b in tl.static_range(BITS):
        byte = tl.load(base + b * (D // 8), mask=ok[:, None], other=0).to(tl.int32)
        val += ((byte[:, :, None] >> t[None, None, :]) & 1) << b
    return tl.reshape(val, [BLOCK, D])


@triton.jit
def _value_groups(ptr, slot, h, stride_vss, stride_vsh, ok, BLOCK: tl.constexpr, D: tl.constexpr, GS: tl.constexpr):
    """V scale or zero ``[BLOCK, D]`` fp32: the ``D / GS`` per-slot values read once and repeated over their
    ``GS`` channels by a broadcast and reshape (not ``GS`` gathers of the same address per channel)."""
    NG: tl.constexpr = D // GS
    x = tl.load(ptr + slot[:, None] * stride_vss + h * stride_vsh + tl.arange(0, NG)[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(x[:, :, None], [BLOCK, NG, GS]), [BLOCK, D])


@triton.jit
def _decode_kernel(q, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token,
                   req_pool_indices, seq_lens, ws_m, ws_l, ws_acc, stride_qb, stride_qh, stride_cs, stride_ch,
                   stride_ksp, stride_ksh, stride_vss, stride_vsh, stride_rr, stride_rt, stride_rh, stride_r2t,
                   scale, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   GS: tl.constexpr, BITS: tl.constexpr, PPI: tl.constexpr, NSPLIT: tl.constexpr):
    """Program (request x KV head, split): its share of the row's whole pages, ``PPI`` pages an iteration (one
    unless a page is under ``tl.dot``'s 16 rows), then, in the last split, the row's open page (the residual).
    The server's page size is ``GS`` (``KIVIStore._check``), so a row's page ``p`` is the ``GS`` contiguous
    slots from ``req_to_token[row, p * GS]``: one slot read per page, and the page's key scale and zero
    read once as ``[D]`` vectors when an iteration is one page."""
    BLOCK: tl.constexpr = PPI * GS
    rh = tl.program_id(0)
    pid = tl.program_id(1)
    i = rh // HKV
    h = rh % HKV
    n = tl.load(seq_lens + i)
    npages = n // GS
    per = tl.cdiv(tl.cdiv(npages, NSPLIT), PPI) * PPI
    lo = pid * per
    hi = tl.minimum(lo + per, npages)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    row_ptr = req_to_token + row * stride_r2t
    qv = group_queries(q, i, h, stride_qb, stride_qh, G, GP, D)
    d = tl.arange(0, D)
    o = tl.arange(0, BLOCK)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for pg in range(lo, hi, PPI):
        if PPI == 1:
            slot0 = tl.load(row_ptr + pg * GS).to(tl.int64)
            page = slot0 // GS
            ok = o < BLOCK
            slot = slot0 + o
            ks = tl.load(k_scale + page * stride_ksp + h * stride_ksh + d).to(tl.float32)
            kz = tl.load(k_zero + page * stride_ksp + h * stride_ksh + d).to(tl.float32)
            kk = _page_codes(k_codes, slot, h, stride_cs, stride_ch, ok, BLOCK, BITS, D).to(tl.float32) * ks[None, :]
            kk += kz[None, :]
        else:  # pages under 16 slots: several a block, each position's page scale gathered (GS-fold, GS <= 8)
            pp = pg + o // GS
            ok = pp < hi
            slot = tl.load(row_ptr + pp * GS, mask=ok, other=0).to(tl.int64) + o % GS
            kso = (slot // GS)[:, None] * stride_ksp + h * stride_ksh + d[None, :]
            ks2 = tl.load(k_scale + kso, mask=ok[:, None], other=0.0).to(tl.float32)
            kz2 = tl.load(k_zero + kso, mask=ok[:, None], other=0.0).to(tl.float32)
            kk = _page_codes(k_codes, slot, h, stride_cs, stride_ch, ok, BLOCK, BITS, D).to(tl.float32) * ks2 + kz2
        s = tl.dot(qv, tl.trans(kk)) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        vv = _page_codes(v_codes, slot, h, stride_cs, stride_ch, ok, BLOCK, BITS, D).to(tl.float32)
        vv = vv * _value_groups(v_scale, slot, h, stride_vss, stride_vsh, ok, BLOCK, D, GS)
        vv += _value_groups(v_zero, slot, h, stride_vss, stride_vsh, ok, BLOCK, D, GS)
        m, den, acc = online_step(m, den, acc, s, vv)
    whole = npages * GS
    if (pid == NSPLIT - 1) & (n > whole):  # the open page, once per row (positions whole..n-1 < whole + GS)
        ok = o < n - whole
        roff = row * stride_rr + o.to(tl.int64)[:, None] * stride_rt + h * stride_rh + d[None, :]
        kr = tl.load(res_k + roff, mask=ok[:, None], other=0.0).to(tl.float32)
        vr = tl.load(res_v + roff, mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.where(ok[None, :], tl.dot(qv, tl.trans(kr)) * scale, float("-inf"))
        m, den, acc = online_step(m, den, acc, s, vr)
    store_split(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, D)


def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor,
                     k_zero: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, res_k: torch.Tensor,
                     res_v: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, bits: int, group: int,
                     splits: int | None = None) -> torch.Tensor:
    """KIVI decode, one Triton kernel over the batch then the splits' merge; no host sync (loop bounds from
    ``seq_lens`` on the device; grid and ``splits`` from static shapes, :func:`decode_splits` by default).
    ``q`` ``[bs, Hq, D]`` -> ``[bs, Hq, D]``. The pool's page size must be ``group`` (the store checks it):
    the kernel reads a page as the ``group`` slots following its first."""
    bs, hq, d = q.shape
    hkv = k_codes.shape[1]
    if bs == 0:
        return torch.empty_like(q)
    assert d & (d - 1) == 0 and d % group == 0 and group & (group - 1) == 0, \
        "head_dim and group must be powers of two, head_dim whole value groups"
    assert k_scale.shape[0] * group >= k_codes.shape[0], "one key scale per group-sized page"
    assert k_codes.shape[2:] == (bits, d // 8) and k_codes.stride(3) == 1 and k_codes.stride(2) == d // 8
    assert v_codes.stride() == k_codes.stride() and k_zero.stride() == k_scale.stride() and k_scale.stride(2) == 1
    assert v_zero.stride() == v_scale.stride() and v_scale.stride(2) == 1
    assert res_v.stride() == res_k.stride() and res_k.stride(3) == 1 and res_k.shape[1] == group
    g = hq // hkv
    if splits is None:
        splits = decode_splits(bs * hkv, req_to_token.shape[1])
    ws_m, ws_l, ws_acc = split_workspace(bs * hkv, splits, g, d, q.device)
    ppi = max(1, 16 // group)  # tl.dot's 16-row minimum, on the GPU
    _decode_kernel[(bs * hkv, splits)](
        q, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token, req_pool_indices,
        seq_lens, ws_m, ws_l, ws_acc, q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1),
        k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1), res_k.stride(0),
        res_k.stride(1), res_k.stride(2), req_to_token.stride(0), scale, HKV=hkv, G=g,
        GP=max(16, triton.next_power_of_2(g)), D=d, GS=group, BITS=bits, PPI=ppi, NSPLIT=splits,
        # [BLOCK, D] fp32 tiles (codes, K, V, V's scale and zero): 32 registers each per thread at 4 warps and a
        # 32-slot page; 8 warps from 64-slot blocks so they stay in registers. Two stages: the next page's
        # slot and codes can be in flight while this one is computed.
        num_warps=4 if ppi * group <= 32 else 8, num_stages=2)
    return merge_splits(ws_m, ws_l, ws_acc).view(bs, hq, d).to(q.dtype)


def prefix_attention(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor,
                     k_zero: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, res_k: torch.Tensor,
                     res_v: torch.Tensor, qo_indptr: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, scale: float, bits: int, group: int,
                     extend_lens: list[int], block_m: int, block_n: int = 64,
                     prefix_lens_host: list[int] | None = None, ws_tokens: int = WS_TOKENS,
                     blocks: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI extend over the cached prefix: ``q`` ``[n, Hq, D]`` (request ``i``'s rows from ``qo_indptr[i]``) over
    the first ``prefix_lens[i]`` positions of its row -> (output, fp32 natural log-sum-exp ``[n, Hq]``, ``-inf``
    over an empty prefix). ``extend_lens``: each request's new tokens (host); ``prefix_lens_host``: the prefix
    lengths on the host if the caller has them (else one host read per call: extend steps run eagerly);
    ``blocks``: ``fp8_attention.prefix_blocks(extend_lens, block_m)`` if the caller keeps them for the step
    (used when one pass holds every prefix)."""
    n, hq, d = q.shape
    hkv = k_codes.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((n, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 0:
        return out, lse
    lens = prefix_lens_host if prefix_lens_host is not None else prefix_lens.tolist()
    g = hq // hkv
    passes = prefix_passes(lens, ws_tokens)
    for members in passes:
        ws_start, at = pass_starts(lens, members, q.device)
        wk = torch.empty(at, hkv, d, dtype=q.dtype, device=q.device)
        wv = torch.empty_like(wk)
        longest = max(lens[i] for i in members)
        _dequant_kernel[(len(lens), hkv, triton.cdiv(longest, DEQUANT_BLOCK))](
            k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token, req_pool_indices,
            prefix_lens, ws_start, wk, wv, k_codes.stride(0), k_codes.stride(1), k_scale.stride(0),
            k_scale.stride(1), v_scale.stride(0), v_scale.stride(1), res_k.stride(0), res_k.stride(1),
            res_k.stride(2), req_to_token.stride(0), wk.stride(0), wk.stride(1), D=d, GS=group, BITS=bits,
            BLOCK=DEQUANT_BLOCK)
        if blocks is not None and len(passes) == 1:
            blk_req, blk_start = blocks  # requests without a prefix read nothing (their prefix length is 0)
        else:
            chosen = set(members)
            blk_req, blk_start = fp8_attention.prefix_blocks(
                [m if i in chosen else 0 for i, m in enumerate(extend_lens)], block_m, q.device)
        if not blk_req.numel():
            continue
        _prefix_kernel[(blk_req.shape[0], hkv)](
            q, wk, wv, qo_indptr, prefix_lens, ws_start, blk_req, blk_start, out, lse, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), wk.stride(0), wk.stride(1), scale, HQ=hq, G=g,
            GP=triton.next_power_of_2(g), D=d, BLOCK_M=block_m, BLOCK_N=block_n)
    return out, lse
