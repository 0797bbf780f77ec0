"""Decode and extend attention over KIVI's layout (``methods/quantization/kivi.py``), dequantized in registers.

Layout, per layer: K and V codes ``[slots, Hkv, W]`` uint8, chunk-major (``kernels/quant.py::pack_chunks``, read through
``kernels/chunks.py``): ``W = D * bits / 8`` bytes a token and head, ``P = 8 / bits`` chunks, byte ``j`` holding
channel ``c * W + j`` in its ``c``-th lane; K scale and zero ``[pages, Hkv, D]`` (one page = one key group),
V scale and zero ``[slots, Hkv, D / GS]``, fp16; the residual ``[rows, GS, Hkv, D]`` holds each request's
positions past its last whole page, in the model dtype.

Decode grid: request x KV head x ``splits`` (``splits.decode_splits``: more for wide rows and small batches),
merged by ``splits.merge_splits`` (one kernel). Each program walks whole pages of its row (the pool's page
size is the group size ``GS``),
``PPI`` pages an iteration (128 positions' worth for pages of 16 to 128 slots, enough for 16 positions under 16):
one ``req_to_token`` read gives a page's ``GS`` contiguous slots; the row's open page (the residual) is read once,
by the last split. The queries are read once, as ``P`` chunks ``[G, W]`` (scaled). Per page:

* keys: the ``[GS, W]`` byte tile is read once (contiguous) and every chunk turned into bf16 ``128 + code * unit``
  by :func:`chunks.chunks_16` (in PTX on the GPU: a ``prmt`` per 4 bytes, a ``lop3`` per 2 codes, no conversion);
  the page's key scale (and ``1 / unit``) is folded into the query chunk (``q'_c = q_c * ks_c`` in bf16: ``G x W``
  multiplies a page, not ``GS x W``), the zero point and the offset into one constant a query row
  (``q . kz - 128 * sum(q')``, the same bf16 ``q'``: the offset cancels in the algebra; the fp32 sums carry its
  magnitude, ~4 bits of their 24); logits ``+= dot(q'_c, k_c^T)`` on the tensor cores; several pages an iteration
  stack their pages' ``q'`` as the rows of one tile (:func:`_logits_stacked`);
* values: per piece (``U = min(W, GS)`` channels of one chunk in one value group: ``D / U`` pieces, each its
  own ``[G, U]`` accumulator, stored at its channels), the codes as bf16 ``128 + code * unit`` as for keys, the
  tokens' scale folded into the probabilities (``p' = p * vs`` in bf16, ``G x GS`` a piece) and their zero point
  and the offset into a row sum (``p . vz - 128 * sum(p')``). Not fp16: ``p * vs / unit`` of a long context's
  many small weights falls under fp16's normal range (6e-5) and rounds to 0 under 3e-8, a systematic loss (a
  review's CPU emulation at 131K positions, values of std 0.01: 5e-2 of the output's largest value, against
  3e-3 in bf16).

Why this layout: bit-planes (``bits`` planes of ``D / 8`` bytes) were ALU-bound at ~4 integer ops per bit and
element plus a reshape a page, and chunk-major codes taken as fp32 (an AND and a float add an element, TF32 dots)
cost more instructions than the 16-bit codes above; stacking several pages an iteration cuts the per-page cost of
the thin query tiles (shared-memory layout conversions, index arithmetic, the softmax, a ``p'`` per value piece),
which dominates over unpacking (~1 instruction an element, ``benchmarks/sass_counts.py``). Its speed against bf16
is in BENCHMARKS.md.

A second form of the loop, :func:`_decode_kernel_key_rows` (``decode_attention(..., key_rows=True)``; served at 4
bits on the GPU, :data:`SERVED_LOOP`; ``benchmarks/quant_decode.py --kivi-tiles`` times both): the block's keys as
the rows of every dot, as Palu's
served kernel has them (``palu_attention._decode_kernel_key_rows``). The query-rows form above puts the thin query
tile (``G`` rows, padded to the tensor cores' 16) on the left and the keys transposed on the right, through shared
memory every page; here logits ``[BLOCK, GP] = dot(k_c [BLOCK, W], q'_c [W, GP])`` (stacked pages: their folded
queries side by side, ``[W, PPI * GP]``, each position taking its page's columns), the softmax along the positions,
and each output piece ``[U, GP] += dot(v_c^T [U, BLOCK], p' [BLOCK, GP])``, the value codes loaded as
``[U, BLOCK]``. The same pages, splits, residual, folds and dtypes: it matches the torch path as the other does.

Extend (:func:`prefix_attention`): the step's cached prefixes are first dequantized once into a workspace in
the model dtype (``[prefix tokens, Hkv, D]`` for K and V, a chunk at a time, at most ``WS_TOKENS`` prefix
tokens a pass: a 130K prefix takes 0.5 GB a layer), then blocks of ``BLOCK_M`` new tokens of one request x KV
head (the group's query heads as rows of one tile) attend over it with the tensor cores in that dtype; output
and natural log-sum-exp, merged by the caller with the new tokens' own attention. Why a workspace: an extend
tile that dequantized the prefix itself would do so once per block of new tokens, i.e. 1,024 times for a 16K
chunk; the workspace dequantizes each prefix token once per layer and chunk. The
store's torch path is the reference of both kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels import fp8_attention
from sgl_sparse.kernels.chunks import (
    MAGIC,
    chunk_float,
    chunk_offset,
    chunk_unit,
    chunk_width,
    chunks_16,
    code_bytes,
    code_tile,
    dot_nn,
    dot_nt,
    query_chunks,
    store_split_chunks,
    zero_pieces,
)
from sgl_sparse.kernels.splits import (
    decode_splits,
    extend_rows,
    merge_splits,
    online_step_weighted,
    pass_starts,
    prefix_passes,
    softmax_step,
    split_bounds,
    split_workspace,
    store_rows,
    workspace_span,
)

# Decode: positions an iteration where a page has >= 16 slots, in whole pages (2 or more stack their key scales,
# _logits_stacked). 128 positions (4 pages of 32 slots) at 2 warps was the fastest choice at 32-slot pages
# (benchmarks/quant_decode.py --kivi-pages times the others). Other page sizes keep the 128 positions: 64- and
# 128-slot pages as 2 and 1 (4 of them would spill to the stack, benchmarks/sass_counts.py --page).
BLOCK_POSITIONS = 128
# The GPU's loop by bits: (keys as rows, pipeline stages). 4 bits: keys as rows at 5 stages took 921 us a layer at
# 6 x 130K on an H100 against 1,029 for queries as rows at 2 (BENCHMARKS.md); 2 bits not timed in that form.
SERVED_LOOP: dict[int, tuple[bool, int]] = {4: (True, 5)}
WS_TOKENS = 1 << 18  # prefix tokens dequantized per pass (K and V: 1 GB at 8 KV heads x 128 in bf16)
DEQUANT_BLOCK = 64


@triton.jit
def _kv_chunk(kb, vb, k_scale, k_zero, v_scale, v_zero, res_k, res_v, row, h, pos, slot, quant, res, whole,
              stride_ksp, stride_ksh, stride_vss, stride_vsh, stride_rr, stride_rt, stride_rh, c: tl.constexpr,
              BLOCK: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr):
    """K and V chunk ``c`` (channels ``[c W, (c + 1) W)``, fp32 ``[BLOCK, W]``) of a row's positions ``pos``, from
    their byte tiles ``kb`` / ``vb`` (MAGIC OR'd in): dequantized where ``quant``, the residual where ``res``. The
    scales are gathered per element (each position's page for K, each channel's group for V): the extend's
    workspace pass, once per prefix token and layer, not the decode loop."""
    W: tl.constexpr = D * BITS // 8
    ch = c * W + tl.arange(0, W)
    lane = 1.0 / (1 << (c * BITS))  # chunk_float gives code * 2**(c * BITS)
    kso = (slot // GS)[:, None] * stride_ksp + h * stride_ksh + ch[None, :]
    ks = tl.load(k_scale + kso, mask=quant[:, None], other=0.0).to(tl.float32) * lane
    kz = tl.load(k_zero + kso, mask=quant[:, None], other=0.0).to(tl.float32)
    vso = slot[:, None] * stride_vss + h * stride_vsh + (ch // GS)[None, :]
    vs = tl.load(v_scale + vso, mask=quant[:, None], other=0.0).to(tl.float32) * lane
    vz = tl.load(v_zero + vso, mask=quant[:, None], other=0.0).to(tl.float32)
    kq = chunk_float(kb, c, BITS) * ks + kz
    vq = chunk_float(vb, c, BITS) * vs + vz
    roff = row * stride_rr + (pos - whole).to(tl.int64)[:, None] * stride_rt + h * stride_rh + ch[None, :]
    kr = tl.load(res_k + roff, mask=res[:, None], other=0.0).to(tl.float32)
    vr = tl.load(res_v + roff, mask=res[:, None], other=0.0).to(tl.float32)
    return tl.where(res[:, None], kr, kq), tl.where(res[:, None], vr, vq)


@triton.jit
def _dequant_kernel(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token, req_pool_indices,
                    prefix_lens, ws_start, wk, wv, stride_cs, stride_ch, stride_ksp, stride_ksh, stride_vss,
                    stride_vsh, stride_rr, stride_rt, stride_rh, stride_r2t, stride_wt, stride_wh, D: tl.constexpr,
                    GS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Request ``program_id(0)``'s cached prefix, KV head ``program_id(1)``, positions of block ``program_id(2)``:
    dequantized into the workspace from row ``ws_start[i]`` (``-1``: not in this pass), a chunk at a time."""
    W: tl.constexpr = D * BITS // 8
    i, h, n, base, pos, ok = workspace_span(prefix_lens, ws_start, BLOCK)
    whole = n // GS * GS
    row = tl.load(req_pool_indices + i).to(tl.int64)
    quant = ok & (pos < whole)
    res = ok & (pos >= whole)
    slot = tl.load(req_to_token + row * stride_r2t + pos, mask=quant, other=0).to(tl.int64)
    kb = code_bytes(k_codes, slot, h, stride_cs, stride_ch, quant, 0, BLOCK, W) | MAGIC
    vb = code_bytes(v_codes, slot, h, stride_cs, stride_ch, quant, 0, BLOCK, W) | MAGIC
    off = (base + pos.to(tl.int64))[:, None] * stride_wt + h * stride_wh + tl.arange(0, W)[None, :]
    for c in tl.static_range(8 // BITS):
        kk, vv = _kv_chunk(kb, vb, k_scale, k_zero, v_scale, v_zero, res_k, res_v, row, h, pos, slot, quant, res,
                           whole, stride_ksp, stride_ksh, stride_vss, stride_vsh, stride_rr, stride_rt, stride_rh, c,
                           BLOCK, D, GS, BITS)
        tl.store(wk + off + c * W, kk.to(wk.dtype.element_ty), mask=ok[:, None])
        tl.store(wv + off + c * W, vv.to(wv.dtype.element_ty), mask=ok[:, None])


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
def _logits(qs, k_codes, k_scale, k_zero, slot, page, h, ok, stride_cs, stride_ch, stride_ksp, stride_ksh,
            GP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr,
            PPI: tl.constexpr, NATIVE: tl.constexpr):
    """Logits ``[GP, BLOCK]`` of the query chunks ``qs`` (scaled) over the keys at ``slot``, the byte tile read once.
    One page (``PPI == 1``): every chunk as bf16 ``OFFSET + code * unit`` (:func:`chunks_16`, :func:`chunk_unit`)
    against the query chunk times the page's key scale in bf16 (``[GP, W]`` a page, not ``[BLOCK, W]``), on the
    tensor cores;
    the zero point and the offset fold into one constant a query row (``q . kz - OFFSET * sum(q')``, with the same
    bf16 ``q'``). Several pages (``GS < 16``): fp32 codes (:func:`chunk_float`), dequantized per element."""
    W: tl.constexpr = D * BITS // 8
    j = tl.arange(0, W)
    s = tl.zeros([GP, BLOCK], tl.float32)
    qkz = tl.zeros([GP], tl.float32)
    if PPI == 1:
        # bf16 on the key side: the query's range (fp16 would overflow past 65,504)
        kc = chunks_16(code_tile(k_codes, slot, h, stride_cs, stride_ch, ok, 0, BLOCK, W), BITS, False, NATIVE)
        for c in tl.static_range(8 // BITS):
            kso = page * stride_ksp + h * stride_ksh + c * W + j
            ks = tl.load(k_scale + kso).to(tl.float32) * chunk_unit(c, BITS, False)
            kz = tl.load(k_zero + kso).to(tl.float32)
            qb = (qs[c] * ks[None, :]).to(kc[c].dtype)
            s += dot_nt(qb, kc[c])
            qkz += tl.sum(qs[c] * kz[None, :], 1) - chunk_offset(False) * tl.sum(qb.to(tl.float32), 1)
    else:
        kb = code_bytes(k_codes, slot, h, stride_cs, stride_ch, ok, 0, BLOCK, W) | MAGIC
        for c in tl.static_range(8 // BITS):
            kso = (slot // GS)[:, None] * stride_ksp + h * stride_ksh + c * W + j[None, :]
            ks = tl.load(k_scale + kso, mask=ok[:, None], other=0.0).to(tl.float32) * (1.0 / (1 << (c * BITS)))
            kz = tl.load(k_zero + kso, mask=ok[:, None], other=0.0).to(tl.float32)
            s += dot_nt(qs[c], chunk_float(kb, c, BITS) * ks + kz)
    return s + qkz[:, None]


@triton.jit
def _logits_stacked(qs, k_codes, k_scale, k_zero, slot, first, h, ok, pok, stride_cs, stride_ch, stride_ksp,
                    stride_ksh, GP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, GS: tl.constexpr,
                    BITS: tl.constexpr, PPI: tl.constexpr, NATIVE: tl.constexpr):
    """:func:`_logits` over ``PPI`` whole pages at once (``BLOCK = PPI * GS`` positions; ``first``: each page's first
    slot, ``pok``: which pages are the program's). Each page needs the query times its own key scale, so the ``PPI``
    folded queries are stacked as the rows of one tile (``[PPI * GP, W]``: 16 rows for 4 pages of a group of 4, which
    the tensor cores pad a group's 4 rows to anyway) against the block's keys; each position then takes the row of
    its own page (a masked sum over the stack), with its page's constant (``q . kz - OFFSET * sum(q')``)."""
    W: tl.constexpr = D * BITS // 8
    j = tl.arange(0, W)
    kc = chunks_16(code_tile(k_codes, slot, h, stride_cs, stride_ch, ok, 0, BLOCK, W), BITS, False, NATIVE)
    page = first // GS
    s = tl.zeros([PPI * GP, BLOCK], tl.float32)
    qkz = tl.zeros([PPI, GP], tl.float32)
    for c in tl.static_range(8 // BITS):
        kso = page[:, None] * stride_ksp + h * stride_ksh + c * W + j[None, :]
        ks = tl.load(k_scale + kso, mask=pok[:, None], other=0.0).to(tl.float32) * chunk_unit(c, BITS, False)
        kz = tl.load(k_zero + kso, mask=pok[:, None], other=0.0).to(tl.float32)
        qb = (qs[c][None, :, :] * ks[:, None, :]).to(kc[c].dtype)  # [PPI, GP, W]
        s += dot_nt(tl.reshape(qb, (PPI * GP, W)), kc[c])
        qkz += tl.sum(qs[c][None, :, :] * kz[:, None, :], 2) - chunk_offset(False) * tl.sum(qb.to(tl.float32), 2)
    s3 = tl.reshape(s, (PPI, GP, BLOCK)) + qkz[:, :, None]
    mine = tl.arange(0, PPI)[:, None, None] == (tl.arange(0, BLOCK) // GS)[None, None, :]
    return tl.sum(tl.where(mine, s3, 0.0), 0)


@triton.jit
def _scales_zeros(v_scale, v_zero, slot, h, ok, stride_vss, stride_vsh, NG: tl.constexpr, PAIRED: tl.constexpr):
    """With ``PAIRED``, the value scales and zero points of the tokens at ``slot``, every group's, as one
    ``[BLOCK, 2 * NG]`` fp32 load (scales, then zeros): one load, so that Triton's pipeliner, which follows only
    what feeds a dot's operands, issues the zeros (which only shift the dot's result) ahead with the scales instead
    of waiting on them each iteration, and a token's ``NG`` fp16 a copy (one fp16 a load is too narrow to
    pipeline). Without, a placeholder (:func:`_scale_zero` loads each group apart)."""
    if PAIRED:
        c = tl.arange(0, 2 * NG)
        base = (slot * stride_vss + h * stride_vsh)[:, None]
        ptr = tl.where(c[None, :] < NG, v_scale + base + c[None, :], v_zero + base + (c[None, :] - NG))
        return tl.load(ptr, mask=ok[:, None], other=0.0).to(tl.float32)
    else:
        return 0.0  # unused: _scale_zero loads each group


@triton.jit
def _scale_zero(sz, v_scale, v_zero, slot, h, ok, stride_vss, stride_vsh, gk, NG: tl.constexpr,
                PAIRED: tl.constexpr):
    """Group ``gk``'s value scale and zero point ``[BLOCK]`` fp32 of the tokens at ``slot``: columns of
    :func:`_scales_zeros`' tile (a token's columns in one thread: no exchange), else loaded."""
    if PAIRED:
        c = tl.arange(0, 2 * NG)[None, :]
        return tl.sum(tl.where(c == gk, sz, 0.0), 1), tl.sum(tl.where(c == NG + gk, sz, 0.0), 1)
    else:
        vso = slot * stride_vss + h * stride_vsh + gk
        return (tl.load(v_scale + vso, mask=ok, other=0.0).to(tl.float32),
                tl.load(v_zero + vso, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _values(acc, p, alpha, v_codes, v_scale, v_zero, slot, h, ok, stride_cs, stride_ch, stride_vss, stride_vsh,
            BLOCK: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, NATIVE: tl.constexpr,
            PAIRED: tl.constexpr):
    """The output pieces ``acc`` (``D / U`` pieces ``[GP, U]``, ``U = min(W, GS)``: each piece one chunk's channels
    in one value group) rescaled by ``alpha`` plus ``p`` times the values at ``slot``. A piece's scale and zero are
    ``[BLOCK]`` vectors (one group a token): the scale folds into the probabilities (``p' = p * vs`` in bf16, against
    the codes as :func:`chunks_16` gives them), the zero point and the offset into one row sum
    (``p . vz - OFFSET * sum(p')``)."""
    W: tl.constexpr = D * BITS // 8
    U: tl.constexpr = W if W < GS else GS
    NS: tl.constexpr = W // U
    vc = ()
    for sub in tl.static_range(NS):
        # bf16, not fp16: p * vs falls under fp16's normal range over long contexts (module docstring)
        t = chunks_16(code_tile(v_codes, slot, h, stride_cs, stride_ch, ok, sub * U, BLOCK, U), BITS, False, NATIVE)
        for ci in tl.static_range(8 // BITS):
            vc = vc + (t[ci],)  # flat: sub-tile sub's chunk ci at sub * P + ci
    out = ()
    NG: tl.constexpr = D // GS
    sz = _scales_zeros(v_scale, v_zero, slot, h, ok, stride_vss, stride_vsh, NG, PAIRED)
    for k in tl.static_range(D // U):
        c = k // NS
        vs, vz = _scale_zero(sz, v_scale, v_zero, slot, h, ok, stride_vss, stride_vsh, (k * U) // GS, NG, PAIRED)
        vs = vs * chunk_unit(c, BITS, False)
        vk = vc[(k % NS) * (8 // BITS) + k // NS]
        pb = (p * vs[None, :]).to(vk.dtype)
        off = tl.sum(p * vz[None, :], 1) - chunk_offset(False) * tl.sum(pb.to(tl.float32), 1)
        pv = tl.dot(pb, vk) + off[:, None]
        out = out + (acc[k] * alpha[:, None] + pv,)
    return out


@triton.jit
def _residual(qs, acc, m, den, res_k, res_v, row, h, n_open, stride_rr, stride_rt, stride_rh, GP: tl.constexpr,
              BLOCK: tl.constexpr, D: tl.constexpr, W: tl.constexpr, U: tl.constexpr):
    """The row's open page (its first ``n_open`` residual positions, full precision) into the softmax state."""
    o = tl.arange(0, BLOCK)
    ok = o < n_open
    base = row * stride_rr + o.to(tl.int64)[:, None] * stride_rt + h * stride_rh
    s = tl.zeros([GP, BLOCK], tl.float32)
    for c in tl.static_range(D // W):
        kr = tl.load(res_k + base + c * W + tl.arange(0, W)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s += dot_nt(qs[c], kr)
    m, den, p, alpha = softmax_step(m, den, tl.where(ok[None, :], s, float("-inf")))
    out = ()
    for k in tl.static_range(D // U):
        vr = tl.load(res_v + base + k * U + tl.arange(0, U)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        out = out + (acc[k] * alpha[:, None] + tl.dot(p, vr),)
    return out, m, den


@triton.jit
def _page_block(row_ptr, pg, hi, o, GS: tl.constexpr, PPI: tl.constexpr, STACK: tl.constexpr):
    """The block of pages from ``pg`` (``PPI`` of them, those under ``hi`` the program's): each position's slot and
    whether it is the program's, with ``STACK`` each page's first slot and whether it is the program's, else (one
    page) the page's index (0 for pages under 16 slots, several a block: each position's page is its slot's).
    A page's ``GS`` slots are contiguous from its first: one ``req_to_token`` read a page."""
    BLOCK: tl.constexpr = PPI * GS
    if STACK:  # whole pages of >= 16 slots, PPI of them: the key scales per page
        pi = pg + tl.arange(0, PPI)
        pok = pi < hi
        first = tl.load(row_ptr + pi * GS, mask=pok, other=0).to(tl.int64)
        slot = tl.reshape(first[:, None] + tl.arange(0, GS)[None, :], (BLOCK,))
        ok = (pg + o // GS) < hi
        page = 0  # each page's scales are read through first
    else:
        pok = tl.full([PPI], True, tl.int1)
        if PPI == 1:
            slot0 = tl.load(row_ptr + pg * GS).to(tl.int64)
            page = slot0 // GS
            ok = o < BLOCK
            slot = slot0 + o
        else:  # pages under 16 slots: several a block, each position's page scale gathered (GS-fold, GS <= 8)
            pp = pg + o // GS
            ok = pp < hi
            page = 0
            slot = tl.load(row_ptr + pp * GS, mask=ok, other=0).to(tl.int64) + o % GS
        first = slot // GS * GS  # first and pok: read by the stacked path only (compiled away here)
    return slot, ok, first, pok, page


@triton.jit
def _page_span(seq_lens, req_pool_indices, req_to_token, stride_r2t, HKV: tl.constexpr, GS: tl.constexpr,
               PPI: tl.constexpr, NSPLIT: tl.constexpr):
    """A decode program's (request x KV head ``rh``, split ``pid``) share of its row's whole pages, ``[lo, hi)`` in
    whole ``PPI``s: with request ``i``, KV head ``h``, the row's length ``n`` and pages ``npages``, its
    ``req_to_token`` row and that row's pointer."""
    rh = tl.program_id(0)
    pid = tl.program_id(1)
    i = rh // HKV
    n = tl.load(seq_lens + i)
    npages = n // GS
    lo, hi = split_bounds(npages, pid, PPI, NSPLIT)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    return rh, pid, i, rh % HKV, n, npages, lo, hi, row, req_to_token + row * stride_r2t


@triton.jit
def _decode_kernel(q, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token,
                   req_pool_indices, seq_lens, ws_m, ws_l, ws_acc, stride_qb, stride_qh, stride_cs, stride_ch,
                   stride_ksp, stride_ksh, stride_vss, stride_vsh, stride_rr, stride_rt, stride_rh, stride_r2t,
                   scale, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   GS: tl.constexpr, BITS: tl.constexpr, PPI: tl.constexpr, NSPLIT: tl.constexpr,
                   NATIVE: tl.constexpr, STACK: tl.constexpr, PAIRED: tl.constexpr = False):
    """Program (request x KV head, split): its share of the row's whole pages, ``PPI`` pages an iteration (stacked
    with ``STACK``), then, in the last split, the row's open page (the residual).
    The server's page size is ``GS`` (``KIVIStore._check``), so a row's page ``p`` is the ``GS`` contiguous
    slots from ``req_to_token[row, p * GS]``: one slot read per page. The queries are read once, as chunks;
    the output is kept as ``D / U`` pieces (:func:`_values`)."""
    W: tl.constexpr = D * BITS // 8
    U: tl.constexpr = W if W < GS else GS
    BLOCK: tl.constexpr = PPI * GS
    rh, pid, i, h, n, npages, lo, hi, row, row_ptr = _page_span(seq_lens, req_pool_indices, req_to_token, stride_r2t,
                                                                HKV, GS, PPI, NSPLIT)
    qs = query_chunks(q, i, h, stride_qb, stride_qh, scale, G, GP, W, 8 // BITS)
    o = tl.arange(0, BLOCK)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = zero_pieces(GP, D, U)
    for pg in range(lo, hi, PPI):
        slot, ok, first, pok, page = _page_block(row_ptr, pg, hi, o, GS, PPI, STACK)
        if STACK:
            s = _logits_stacked(qs, k_codes, k_scale, k_zero, slot, first, h, ok, pok, stride_cs, stride_ch,
                                stride_ksp, stride_ksh, GP, BLOCK, D, GS, BITS, PPI, NATIVE)
        else:
            s = _logits(qs, k_codes, k_scale, k_zero, slot, page, h, ok, stride_cs, stride_ch, stride_ksp,
                        stride_ksh, GP, BLOCK, D, GS, BITS, PPI, NATIVE)
        m, den, p, alpha = softmax_step(m, den, tl.where(ok[None, :], s, float("-inf")))
        acc = _values(acc, p, alpha, v_codes, v_scale, v_zero, slot, h, ok, stride_cs, stride_ch, stride_vss,
                      stride_vsh, BLOCK, D, GS, BITS, NATIVE, PAIRED)
    whole = npages * GS
    if (pid == NSPLIT - 1) & (n > whole):  # the open page, once per row (positions whole..n-1 < whole + GS)
        acc, m, den = _residual(qs, acc, m, den, res_k, res_v, row, h, n - whole, stride_rr, stride_rt, stride_rh,
                                GP, BLOCK, D, W, U)
    store_split_chunks(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, D, U)


@triton.jit
def _logits_rows(qt, k_codes, k_scale, k_zero, slot, first, page, h, ok, pok, stride_cs, stride_ch, stride_ksp,
                 stride_ksh, GP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, GS: tl.constexpr,
                 BITS: tl.constexpr, PPI: tl.constexpr, NATIVE: tl.constexpr, STACK: tl.constexpr):
    """:func:`_logits` and :func:`_logits_stacked` with the keys as rows: logits ``[BLOCK, GP]`` of the query chunks
    ``qt`` (``[W, GP]``, scaled) over the keys at ``slot``, each chunk's key tile ``[BLOCK, W]`` the dot's left
    operand. The same folds: a page's key scale into the query chunk in bf16 (``[W, GP]`` a page), its zero point
    and the offset into one constant a query (``q . kz - OFFSET * sum(q')``); with ``STACK`` the ``PPI`` folded
    queries side by side as the columns of one tile (``[W, PPI * GP]``), each position taking its page's columns;
    pages under 16 slots (neither ``STACK`` nor one page) fp32 codes, dequantized per element."""
    W: tl.constexpr = D * BITS // 8
    j = tl.arange(0, W)
    if STACK:
        kc = chunks_16(code_tile(k_codes, slot, h, stride_cs, stride_ch, ok, 0, BLOCK, W), BITS, False, NATIVE)
        pages = first // GS
        s = tl.zeros([BLOCK, PPI * GP], tl.float32)
        qkz = tl.zeros([PPI, GP], tl.float32)
        for c in tl.static_range(8 // BITS):
            kso = pages[None, :] * stride_ksp + h * stride_ksh + c * W + j[:, None]  # [W, PPI]
            ks = tl.load(k_scale + kso, mask=pok[None, :], other=0.0).to(tl.float32) * chunk_unit(c, BITS, False)
            kz = tl.load(k_zero + kso, mask=pok[None, :], other=0.0).to(tl.float32)
            qb = (qt[c][:, None, :] * ks[:, :, None]).to(kc[c].dtype)  # [W, PPI, GP]
            s += dot_nn(kc[c], tl.reshape(qb, (W, PPI * GP)))
            qkz += tl.sum(qt[c][:, None, :] * kz[:, :, None], 0) - chunk_offset(False) * tl.sum(qb.to(tl.float32), 0)
        s3 = tl.reshape(s, (BLOCK, PPI, GP)) + qkz[None, :, :]
        mine = (tl.arange(0, BLOCK) // GS)[:, None, None] == tl.arange(0, PPI)[None, :, None]
        return tl.sum(tl.where(mine, s3, 0.0), 1)
    elif PPI == 1:
        # bf16 on the key side: the query's range (fp16 would overflow past 65,504)
        kc = chunks_16(code_tile(k_codes, slot, h, stride_cs, stride_ch, ok, 0, BLOCK, W), BITS, False, NATIVE)
        s = tl.zeros([BLOCK, GP], tl.float32)
        qkz = tl.zeros([GP], tl.float32)
        for c in tl.static_range(8 // BITS):
            kso = page * stride_ksp + h * stride_ksh + c * W + j
            ks = tl.load(k_scale + kso).to(tl.float32) * chunk_unit(c, BITS, False)
            kz = tl.load(k_zero + kso).to(tl.float32)
            qb = (qt[c] * ks[:, None]).to(kc[c].dtype)
            s += dot_nn(kc[c], qb)
            qkz += tl.sum(qt[c] * kz[:, None], 0) - chunk_offset(False) * tl.sum(qb.to(tl.float32), 0)
        return s + qkz[None, :]
    else:
        kb = code_bytes(k_codes, slot, h, stride_cs, stride_ch, ok, 0, BLOCK, W) | MAGIC
        s = tl.zeros([BLOCK, GP], tl.float32)
        for c in tl.static_range(8 // BITS):
            kso = (slot // GS)[:, None] * stride_ksp + h * stride_ksh + c * W + j[None, :]
            ks = tl.load(k_scale + kso, mask=ok[:, None], other=0.0).to(tl.float32) * (1.0 / (1 << (c * BITS)))
            kz = tl.load(k_zero + kso, mask=ok[:, None], other=0.0).to(tl.float32)
            s += dot_nn(chunk_float(kb, c, BITS) * ks + kz, qt[c])
        return s


@triton.jit
def _values_rows(acc, p, alpha, v_codes, v_scale, v_zero, slot, h, ok, stride_cs, stride_ch, stride_vss,
                 stride_vsh, BLOCK: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr,
                 NATIVE: tl.constexpr, PAIRED: tl.constexpr):
    """:func:`_values` with the keys as rows: pieces ``[U, GP]`` += the piece's codes ``[U, BLOCK]`` (loaded so,
    :func:`code_tile` ``T``) times ``p'`` ``[BLOCK, GP]`` (``p * vs`` in bf16), plus ``p . vz - OFFSET * sum(p')``
    a column."""
    W: tl.constexpr = D * BITS // 8
    U: tl.constexpr = W if W < GS else GS
    NS: tl.constexpr = W // U
    vc = ()
    for sub in tl.static_range(NS):
        t = chunks_16(code_tile(v_codes, slot, h, stride_cs, stride_ch, ok, sub * U, BLOCK, U, True), BITS, False,
                      NATIVE)
        for ci in tl.static_range(8 // BITS):
            vc = vc + (t[ci],)  # flat: sub-tile sub's chunk ci at sub * P + ci
    out = ()
    NG: tl.constexpr = D // GS
    sz = _scales_zeros(v_scale, v_zero, slot, h, ok, stride_vss, stride_vsh, NG, PAIRED)
    for k in tl.static_range(D // U):
        c = k // NS
        vs, vz = _scale_zero(sz, v_scale, v_zero, slot, h, ok, stride_vss, stride_vsh, (k * U) // GS, NG, PAIRED)
        vs = vs * chunk_unit(c, BITS, False)
        vk = vc[(k % NS) * (8 // BITS) + k // NS]
        pb = (p * vs[:, None]).to(vk.dtype)
        off = tl.sum(p * vz[:, None], 0) - chunk_offset(False) * tl.sum(pb.to(tl.float32), 0)
        pv = tl.dot(vk, pb) + off[None, :]
        out = out + (acc[k] * alpha[None, :] + pv,)
    return out


@triton.jit
def _residual_rows(qt, acc, m, den, res_k, res_v, row, h, n_open, stride_rr, stride_rt, stride_rh, GP: tl.constexpr,
                   BLOCK: tl.constexpr, D: tl.constexpr, W: tl.constexpr, U: tl.constexpr):
    """:func:`_residual` with the keys as rows (logits ``[BLOCK, GP]``, the pieces ``[U, GP]``)."""
    o = tl.arange(0, BLOCK)
    ok = o < n_open
    base = row * stride_rr + o.to(tl.int64) * stride_rt + h * stride_rh
    s = tl.zeros([BLOCK, GP], tl.float32)
    for c in tl.static_range(D // W):
        kr = tl.load(res_k + base[:, None] + c * W + tl.arange(0, W)[None, :], mask=ok[:, None],
                     other=0.0).to(tl.float32)
        s += dot_nn(kr, qt[c])
    m, den, p, alpha = softmax_step(m, den, tl.where(ok[:, None], s, float("-inf")), 0)
    out = ()
    for k in tl.static_range(D // U):
        vr = tl.load(res_v + base[None, :] + k * U + tl.arange(0, U)[:, None], mask=ok[None, :],
                     other=0.0).to(tl.float32)  # [U, BLOCK]
        out = out + (acc[k] * alpha[None, :] + tl.dot(vr, p),)
    return out, m, den


@triton.jit
def _decode_kernel_key_rows(q, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token,
                            req_pool_indices, seq_lens, ws_m, ws_l, ws_acc, stride_qb, stride_qh, stride_cs,
                            stride_ch, stride_ksp, stride_ksh, stride_vss, stride_vsh, stride_rr, stride_rt,
                            stride_rh, stride_r2t, scale, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                            D: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, PPI: tl.constexpr,
                            NSPLIT: tl.constexpr, NATIVE: tl.constexpr, STACK: tl.constexpr,
                            PAIRED: tl.constexpr = False):
    """:func:`_decode_kernel` with the block's keys as the rows of every dot: logits ``[BLOCK, GP]`` =
    ``dot(k_c, q'_c)``, the key tile ``[BLOCK, W]`` the left operand (which the tensor cores take from registers)
    and the thin folded queries ``[W, GP]`` the right one, instead of the queries ``[GP, W]`` padded to 16 rows
    against the keys transposed through shared memory; the softmax along the positions (axis 0); the output pieces
    transposed, ``[U, GP]`` += ``dot(v^T [U, BLOCK], p' [BLOCK, GP])``. The same splits, pages, folds and residual;
    the queries are read once, as ``[W, GP]`` chunks."""
    W: tl.constexpr = D * BITS // 8
    U: tl.constexpr = W if W < GS else GS
    BLOCK: tl.constexpr = PPI * GS
    rh, pid, i, h, n, npages, lo, hi, row, row_ptr = _page_span(seq_lens, req_pool_indices, req_to_token, stride_r2t,
                                                                HKV, GS, PPI, NSPLIT)
    qt = query_chunks(q, i, h, stride_qb, stride_qh, scale, G, GP, W, 8 // BITS, True)
    o = tl.arange(0, BLOCK)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = zero_pieces(GP, D, U, True)
    for pg in range(lo, hi, PPI):
        slot, ok, first, pok, page = _page_block(row_ptr, pg, hi, o, GS, PPI, STACK)
        s = _logits_rows(qt, k_codes, k_scale, k_zero, slot, first, page, h, ok, pok, stride_cs, stride_ch,
                         stride_ksp, stride_ksh, GP, BLOCK, D, GS, BITS, PPI, NATIVE, STACK)
        m, den, p, alpha = softmax_step(m, den, tl.where(ok[:, None], s, float("-inf")), 0)
        acc = _values_rows(acc, p, alpha, v_codes, v_scale, v_zero, slot, h, ok, stride_cs, stride_ch, stride_vss,
                           stride_vsh, BLOCK, D, GS, BITS, NATIVE, PAIRED)
    whole = npages * GS
    if (pid == NSPLIT - 1) & (n > whole):  # the open page, once per row (positions whole..n-1 < whole + GS)
        acc, m, den = _residual_rows(qt, acc, m, den, res_k, res_v, row, h, n - whole, stride_rr, stride_rt,
                                     stride_rh, GP, BLOCK, D, W, U)
    store_split_chunks(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, D, U, True)


def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, k_scale: torch.Tensor,
                     k_zero: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, res_k: torch.Tensor,
                     res_v: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, bits: int, group: int,
                     splits: int | None = None, warps: int | None = None, pages: int | None = None,
                     stages: int | None = None, maxnreg: int | None = None,
                     key_rows: bool | None = None, paired_scales: bool = False) -> torch.Tensor:
    """KIVI decode, one Triton kernel over the batch then the splits' merge; no host sync (loop bounds from
    ``seq_lens`` on the device; grid and ``splits`` from static shapes, :func:`decode_splits` by default).
    ``q`` ``[bs, Hq, D]`` -> ``[bs, Hq, D]``. The pool's page size must be ``group`` (the store checks it):
    the kernel reads a page as the ``group`` slots following its first. ``warps``: the kernel's warps (by
    default from the block, see below); ``pages``: pages an iteration (a power of two; by default
    :data:`BLOCK_POSITIONS` worth for pages of 16 slots or more, else enough for 16 positions); ``stages`` (2),
    ``maxnreg`` (registers a thread at most: more blocks an SM): all for timing other choices; ``key_rows``: the
    keys-as-rows form of the loop (:func:`_decode_kernel_key_rows`), the same arithmetic. ``None`` (``key_rows``,
    ``stages``): the served choice, :data:`SERVED_LOOP` by bits on the GPU, else queries as rows at 2 stages.
    ``paired_scales``: a token's value scales and zeros in one load (:func:`_scales_zeros`: every load of the loop
    issued ahead, at more instructions and spills; not yet timed, so not served), else a load a group."""
    bs, hq, d = q.shape
    hkv = k_codes.shape[1]
    if bs == 0:
        return torch.empty_like(q)
    assert d & (d - 1) == 0 and d % group == 0 and group & (group - 1) == 0, \
        "head_dim and group must be powers of two, head_dim whole value groups"
    assert k_scale.shape[0] * group >= k_codes.shape[0], "one key scale per group-sized page"
    assert k_codes.shape[2:] == (chunk_width(d, bits),) and k_codes.stride(2) == 1, "codes [slots, Hkv, D * bits / 8]"
    assert v_codes.stride() == k_codes.stride() and k_zero.stride() == k_scale.stride() and k_scale.stride(2) == 1
    assert v_zero.stride() == v_scale.stride() and v_scale.stride(2) == 1
    assert res_v.stride() == res_k.stride() and res_k.stride(3) == 1 and res_k.shape[1] == group
    g = hq // hkv
    served_rows, served_stages = SERVED_LOOP.get(bits, (False, 2)) if q.is_cuda else (False, 2)
    if key_rows is None:
        key_rows, stages = served_rows, stages or served_stages
    if splits is None:
        splits = decode_splits(bs * hkv, req_to_token.shape[1])
    ws_m, ws_l, ws_acc = split_workspace(bs * hkv, splits, g, d, q.device)
    # p @ V reduces over the block's positions: tl.dot needs 16 of them on a GPU. Pages of 16 or more: stacked
    # (_logits_stacked) from 2 on, BLOCK_POSITIONS by default.
    ppi = max(1, 16 // group, pages or (BLOCK_POSITIONS // group if group >= 16 else 1))
    assert ppi & (ppi - 1) == 0, "pages an iteration: a power of two"
    block = ppi * group
    # One page an iteration takes _logits' single-page path: stacking a single page compiles to more instructions
    # (benchmarks/sass_counts.py).
    stack = group >= 16 and ppi > 1
    kernel = _decode_kernel_key_rows if key_rows else _decode_kernel
    kernel[(bs * hkv, splits)](
        q, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token, req_pool_indices,
        seq_lens, ws_m, ws_l, ws_acc, q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1),
        k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1), res_k.stride(0),
        res_k.stride(1), res_k.stride(2), req_to_token.stride(0), scale, HKV=hkv, G=g,
        # The group's query heads as the rows of the logits and output tiles, padded to a power of two only (Triton
        # pads a dot's rows to the tensor cores' 16 itself): every per-page op on the query side (the key scale's
        # fold, the softmax, the rescale) scales with these rows.
        GP=triton.next_power_of_2(g), D=d, GS=group, BITS=bits, PPI=ppi, NSPLIT=splits, NATIVE=q.is_cuda,
        STACK=stack, PAIRED=paired_scales,
        # Warps by block: for 16- and 32-slot blocks, 2 warps (4 split the tiles so thin that warps repeat each
        # other's decode: twice the instructions per element in the compiled code for sm_90); stacked pages 2 too
        # (see BLOCK_POSITIONS: 4 warps are slower at 2 and 4 pages); 8 for a single 128-slot page. Two
        # stages: the next page's slot and codes can be in flight while this one is computed.
        num_warps=warps or (2 if stack else max(2, block // 16)), num_stages=stages or 2,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return merge_splits(ws_m, ws_l, ws_acc, bs, q.dtype)


def _dequant_pass(buffers: tuple[torch.Tensor, ...], req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                  prefix_lens: torch.Tensor, lens: list[int], members: list[int], bits: int, group: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prefixes of requests ``members`` dequantized into one workspace, request after request in position order
    (whole pages from the codes, the open page from the residual): (each request's first row, ``-1`` outside the
    pass; K ``[rows, Hkv, D]``; V)."""
    k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v = buffers
    hkv, d = k_codes.shape[1], res_k.shape[-1]
    ws_start, at = pass_starts(lens, members, k_codes.device)
    wk = torch.empty(at, hkv, d, dtype=dtype, device=k_codes.device)
    wv = torch.empty_like(wk)
    longest = max(lens[i] for i in members)
    _dequant_kernel[(len(lens), hkv, triton.cdiv(longest, DEQUANT_BLOCK))](
        k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v, req_to_token, req_pool_indices,
        prefix_lens, ws_start, wk, wv, k_codes.stride(0), k_codes.stride(1), k_scale.stride(0),
        k_scale.stride(1), v_scale.stride(0), v_scale.stride(1), res_k.stride(0), res_k.stride(1),
        res_k.stride(2), req_to_token.stride(0), wk.stride(0), wk.stride(1), D=d, GS=group, BITS=bits,
        BLOCK=DEQUANT_BLOCK)
    return ws_start, wk, wv


def dequantize_prefixes(buffers: tuple[torch.Tensor, ...], req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, lens: list[int], bits: int,
                        group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's first ``lens[i]`` positions (``prefix_lens`` on the device, ``lens`` on the host, 0: none)
    dequantized into one flat K and V, request after request: what a dense prefill over the prefix reads
    (``prefix_attention: dequantize``). ``buffers``: ``KIVIStore._buffers(layer)``."""
    _, wk, wv = _dequant_pass(buffers, req_to_token, req_pool_indices, prefix_lens, lens, list(range(len(lens))),
                              bits, group, dtype)
    return wk, wv


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
    buffers = (k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v)
    for members in passes:
        ws_start, wk, wv = _dequant_pass(buffers, req_to_token, req_pool_indices, prefix_lens, lens, members, bits,
                                         group, q.dtype)
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
