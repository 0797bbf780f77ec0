"""Decode and extend attention over TurboQuant's layout (``methods/quantization/turboquant.py``), decoded in
registers without ever rotating a key or a value back.

Layout, per layer: K and V codes ``[slots, Hkv, W]`` uint8, chunk-major (``kernels/quant.py::pack_chunks``, read
through ``kernels/chunks.py``): ``W = D * lane / 8`` bytes, ``P = 8 / lane`` chunks, byte ``j`` holding channel
``c * W + j`` in its ``c``-th lane (``lane`` 2 or 4 bits: 3-bit codes take 4-bit lanes); K and V norms ``[slots,
Hkv]`` fp32; with QJL, the key residual's signs ``[slots, Hkv, D / 8]`` (1-bit lanes: 8 chunks of ``D / 8``) and
norms ``[slots, Hkv]``. A stored vector is ``x = |x| / sqrt(D) * c @ R`` (``c`` its codes' Lloyd-Max levels,
``R`` the orthogonal rotation), so ``q . k = |k| / sqrt(D) * (q @ R^T) . c``: the queries are rotated once, in
torch before the kernel, and each key costs its codebook lookups and one multiply per logit. Values
accumulate in the rotated basis (``p * |v| / sqrt(D) * c``) and the output is rotated back once, in torch
after the kernel (``acc @ R``). With QJL each logit adds ``sqrt(pi / 2) / M * |r| * (q @ S^T) . sign(S r)``
(``quant.qjl_inner``), ``q @ S^T`` also computed once per query. The pool tensors are the store's
contiguous buffers: their strides follow from ``Hkv``, ``W`` and ``D``.

Decode grid: request x KV head x ``splits`` (split-KV, merged by ``splits.merge_splits``, which also applies
the inverse rotation), each program over its share of
the row's ``seq_lens`` tokens read through ``req_to_token``, ``BLOCK`` an iteration, the group's query heads as
rows of one tile. The rotated queries are read once, as ``P`` chunks ``[G, W]``; per block, each code tile
(``[BLOCK, W]`` bytes) is read once and each chunk ``c`` taken with a shift and a mask (``chunks.chunk_code``),
its levels gathered from the codebook held in registers (``tl.gather``: a warp shuffle), and dotted with the
query chunk (keys) or accumulated into output chunk ``c`` (values, ``p * |v|`` against the levels): ``P``
accumulators ``[G, W]``, stored at their channels. QJL's signs: 8 chunks of one bit, each as floats with an AND
and a float add (``chunks.chunk_float``), against the projected query chunk scaled once by ``2**(1 - c)``, less
the query's sum: ``(S q) . (2 bit - 1)``.

Why: on the bit-plane layout this replaced (``bits`` planes of ``D / 8`` bytes), a code was gathered bit by bit,
each bit's byte loaded once per channel: ~4 integer ops and a load per bit and element (16 and 4 at 4 bits), then
its level loaded through a 64-bit address: ~18 integer ops and 5 loads an element at 4 bits. Per element now: a
shift and a mask (none for the last chunk), the byte's extraction shared by its ``P`` codes, and one shuffle: ~2
integer ops and a shuffle at 4 bits, about a third of the bit-plane kernel's SASS instructions an element
(``benchmarks/sass_counts.py`` counts them; the speed against bf16 is in BENCHMARKS.md).

Extend (:func:`prefix_attention`): the step's cached prefixes are decoded once per layer into an fp32 workspace
in the rotated basis (keys, values and QJL's scaled signs; at most ``WS_TOKENS`` prefix tokens a pass), then
blocks of ``BLOCK_M`` new tokens of one request x KV head attend over it; output and natural log-sum-exp, which
the caller merges with the new tokens' own attention. Decoding inside each extend tile instead (the first
version) repeats the codebook lookups of the whole prefix once per block of new tokens.
The store's torch path (``TurboQuantStore.row_attention``) is the reference of both: the kernels
decode in fp32 (their dots in TF32 on the GPU, Triton's default for fp32) where the torch path rounds each
dequantized key and value to the model dtype, so the two agree to that dtype's precision (exactly, up to
summation order, with an fp32 model).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels import fp8_attention
from sgl_sparse.kernels.chunks import (
    MAGIC,
    chunk_code,
    chunk_float,
    code_bytes,
    dot_nt,
    query_chunks,
    store_split_chunks,
    zero_pieces,
)
from sgl_sparse.kernels.splits import (
    decode_splits,
    extend_rows,
    merge_splits,
    online_step,
    pass_starts,
    prefix_passes,
    softmax_step,
    split_span,
    split_workspace,
    store_rows,
    workspace_span,
)

# Prefix tokens decoded per extend pass: K, V and QJL's residual in fp32 (the kernels' precision), 1.5 GB at
# 8 KV heads x 128.
WS_TOKENS = 1 << 17
DEQUANT_BLOCK = 64


class Layer(NamedTuple):
    """One layer of the pool as the kernels read it, with the store's rotation ``R`` and its codebook in a unit
    vector's coordinates (the Lloyd-Max levels / sqrt(D)); the QJL tensors (the residual's signs and norms, the
    projection ``S``) are ``None`` without QJL."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_norm: torch.Tensor
    v_norm: torch.Tensor
    rot: torch.Tensor
    unit_levels: torch.Tensor
    k_signs: torch.Tensor | None = None
    k_rnorm: torch.Tensor | None = None
    proj: torch.Tensor | None = None


@triton.jit
def _codebook(unit_levels, NLEV: tl.constexpr, LANE: tl.constexpr, BLOCK: tl.constexpr):
    """The codebook as a register table ``[BLOCK, 2**LANE]`` (each row the ``NLEV`` levels, 0 past them), for
    ``tl.gather`` along its rows: a lookup is a warp shuffle, where a load from the table in memory costs a 64-bit
    address and a load (about 2 more instructions an element in the compiled loop)."""
    r = tl.arange(0, 1 << LANE)
    row = tl.load(unit_levels + r, mask=r < NLEV, other=0.0)
    return tl.broadcast_to(row[None, :], [BLOCK, 1 << LANE])


@triton.jit
def _logits(qs, qp, qp_sum, k_codes, k_norm, k_signs, k_rnorm, lv, slot, h, ok, scale, qjl_scale,
            HKV: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, LANE: tl.constexpr, BLOCK: tl.constexpr,
            QJL: tl.constexpr):
    """Logits ``[GP, BLOCK]`` of the rotated query chunks ``qs`` over the keys at ``slot``, ``-inf`` where not
    ``ok``: the key bytes read once, each chunk's codebook levels (gathered from ``lv``, :func:`_codebook`) against
    its query chunk. With QJL, the signs'
    bytes (1-bit chunks) read once too, each chunk's bits as floats (``chunks.chunk_float``: ``bit * 2**c``)
    against ``qp_c * 2**(1 - c)`` (prepared once, :func:`_qjl_queries`), minus ``sum(qp)``: ``qp . (2 bit - 1)``."""
    W: tl.constexpr = D * LANE // 8
    kb = code_bytes(k_codes, slot, h, HKV * W, W, ok, 0, BLOCK, W)
    s = tl.zeros([GP, BLOCK], tl.float32)
    for c in tl.static_range(8 // LANE):
        s += dot_nt(qs[c], tl.gather(lv, chunk_code(kb, c, LANE), 1))
    s = s * (tl.load(k_norm + slot * HKV + h, mask=ok, other=0.0) * scale)[None, :]
    if QJL:
        sb = code_bytes(k_signs, slot, h, HKV * (D // 8), D // 8, ok, 0, BLOCK, D // 8) | MAGIC
        sq = tl.zeros([GP, BLOCK], tl.float32)
        for c in tl.static_range(8):
            sq += dot_nt(qp[c], chunk_float(sb, c, 1))
        rn = tl.load(k_rnorm + slot * HKV + h, mask=ok, other=0.0)
        s += (sq - qp_sum[:, None]) * (rn * qjl_scale)[None, :]
    return tl.where(ok[None, :], s, float("-inf"))


@triton.jit
def _qjl_queries(q_proj, i, h, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """The projected queries ``S q`` as 8 chunks of ``D / 8`` (the signs' 1-bit layout), chunk ``c`` times
    ``2**(1 - c)`` (so that against ``bit * 2**c`` it counts ``2 q`` where the bit is set), and ``sum(S q)``
    ``[GP]``: ``qp . (2 bit - 1)`` is their dot minus that sum."""
    qp = query_chunks(q_proj, i, h, HKV * G * D, D, 1.0, G, GP, D // 8, 8)
    out = ()
    total = tl.zeros([GP], tl.float32)
    for c in tl.static_range(8):
        total += tl.sum(qp[c], 1)
        out = out + (qp[c] * (2.0 / (1 << c)),)
    return out, total


@triton.jit
def _decode_kernel(
    q_rot,
    q_proj,
    k_codes,
    v_codes,
    k_norm,
    v_norm,
    k_signs,
    k_rnorm,
    unit_levels,
    req_to_token,
    req_pool_indices,
    seq_lens,
    ws_m,
    ws_l,
    ws_acc,
    stride_r2t,
    scale,
    qjl_scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    LANE: tl.constexpr,
    NLEV: tl.constexpr,
    QJL: tl.constexpr,
    BLOCK: tl.constexpr,
    NSPLIT: tl.constexpr,
):
    """Program (request x KV head, split): its share of the row's positions, ``BLOCK`` an iteration. The rotated
    queries are read once as chunks ``[GP, W]``; the output is kept as ``P`` chunks ``[GP, W]`` of the rotated
    basis, each its own accumulator (``p * |v|`` times the chunk's levels)."""
    W: tl.constexpr = D * LANE // 8
    rh, pid, i, h, _, lo, hi = split_span(seq_lens, HKV, BLOCK, NSPLIT)
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    qs = query_chunks(q_rot, i, h, HKV * G * D, D, 1.0, G, GP, W, 8 // LANE)
    qp = qs
    qp_sum = tl.zeros([GP], tl.float32)
    if QJL:
        qp, qp_sum = _qjl_queries(q_proj, i, h, HKV, G, GP, D)
    lv = _codebook(unit_levels, NLEV, LANE, BLOCK)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = zero_pieces(GP, D, W)
    for start in range(lo, hi, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        ok = pos < hi
        slot = tl.load(row_ptr + pos, mask=ok, other=0).to(tl.int64)
        s = _logits(qs, qp, qp_sum, k_codes, k_norm, k_signs, k_rnorm, lv, slot, h, ok, scale, qjl_scale,
                    HKV, GP, D, LANE, BLOCK, QJL)
        m, den, p, alpha = softmax_step(m, den, s)
        pv = p * tl.load(v_norm + slot * HKV + h, mask=ok, other=0.0)[None, :]
        vb = code_bytes(v_codes, slot, h, HKV * W, W, ok, 0, BLOCK, W)
        out = ()
        for c in tl.static_range(8 // LANE):
            vl = tl.gather(lv, chunk_code(vb, c, LANE), 1)
            out = out + (acc[c] * alpha[:, None] + tl.dot(pv, vl),)
        acc = out
    store_split_chunks(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, D, W)


@triton.jit
def _dequant_kernel(
    k_codes,
    v_codes,
    k_norm,
    v_norm,
    k_signs,
    k_rnorm,
    unit_levels,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    ws_start,
    wk,
    wv,
    wj,
    stride_r2t,
    HKV: tl.constexpr,
    D: tl.constexpr,
    LANE: tl.constexpr,
    QJL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Request ``program_id(0)``'s cached prefix, KV head ``program_id(1)``, positions of block ``program_id(2)``,
    decoded into the workspace from row ``ws_start[i]`` (``-1``: not in this pass), in the rotated basis, a chunk
    at a time: the keys and values (codebook levels x norm) and, with QJL, the key residual's signs x its norm."""
    W: tl.constexpr = D * LANE // 8
    i, h, n, base, pos, ok = workspace_span(prefix_lens, ws_start, BLOCK)
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    slot = tl.load(row_ptr + pos, mask=ok, other=0).to(tl.int64)
    row = (base + pos.to(tl.int64))[:, None] * (HKV * D) + h * D
    kn = tl.load(k_norm + slot * HKV + h, mask=ok, other=0.0)[:, None]
    vn = tl.load(v_norm + slot * HKV + h, mask=ok, other=0.0)[:, None]
    kb = code_bytes(k_codes, slot, h, HKV * W, W, ok, 0, BLOCK, W)
    vb = code_bytes(v_codes, slot, h, HKV * W, W, ok, 0, BLOCK, W)
    for c in tl.static_range(8 // LANE):
        off = row + c * W + tl.arange(0, W)[None, :]
        tl.store(wk + off, tl.load(unit_levels + chunk_code(kb, c, LANE)) * kn, mask=ok[:, None])
        tl.store(wv + off, tl.load(unit_levels + chunk_code(vb, c, LANE)) * vn, mask=ok[:, None])
    if QJL:
        W1: tl.constexpr = D // 8
        sb = code_bytes(k_signs, slot, h, HKV * W1, W1, ok, 0, BLOCK, W1)
        rn = tl.load(k_rnorm + slot * HKV + h, mask=ok, other=0.0)[:, None]
        for c in tl.static_range(8):
            off = row + c * W1 + tl.arange(0, W1)[None, :]
            tl.store(wj + off, (2 * chunk_code(sb, c, 1) - 1).to(tl.float32) * rn, mask=ok[:, None])


@triton.jit
def _prefix_kernel(
    q_rot,
    q_proj,
    wk,
    wv,
    wj,
    qo_indptr,
    prefix_lens,
    ws_start,
    blk_req,
    blk_start,
    out,
    lse,
    scale,
    qjl_scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    QJL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i, tok, head, rm, qv = extend_rows(q_rot, qo_indptr, blk_req, blk_start, HKV * G * D, D, G, GP, D, BLOCK_M)
    qp = qv
    if QJL:
        _, _, _, _, qp = extend_rows(q_proj, qo_indptr, blk_req, blk_start, HKV * G * D, D, G, GP, D, BLOCK_M)
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
        off = (base + pos.to(tl.int64))[:, None] * (HKV * D) + h * D + d[None, :]
        s = tl.dot(qv, tl.trans(tl.load(wk + off, mask=ok[:, None], other=0.0))) * scale
        if QJL:
            s += tl.dot(qp, tl.trans(tl.load(wj + off, mask=ok[:, None], other=0.0))) * qjl_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m, den, acc = online_step(m, den, acc, s, tl.load(wv + off, mask=ok[:, None], other=0.0))
    store_rows(out, lse, tok, head, rm, m, den, acc, HKV * G * D, D, HKV * G, D)


def _inputs(q: torch.Tensor, layer: Layer, scale: float) -> tuple[list[torch.Tensor], list[float]]:
    """The kernels' tensor arguments (``q @ R^T``; ``q @ S^T``; the pool; the codebook) and scalars (the logit
    scale; QJL's, ``scale * sqrt(pi / 2) / M``). Without QJL the QJL arguments repeat others: never read."""
    d = q.shape[-1]
    pool = (layer.k_codes, layer.v_codes, layer.k_norm, layer.v_norm, layer.k_signs, layer.k_rnorm)
    assert all(t is None or t.is_contiguous() for t in pool), "the kernels derive the pool's strides from its shape"
    assert d & (d - 1) == 0 and d >= 16, "head_dim must be a power of two, at least 16 (tl.dot)"
    assert layer.k_codes.dtype == torch.uint8 and layer.k_codes.shape == layer.v_codes.shape
    assert layer.k_codes.shape[2] * 8 // d in (2, 4), "codes [slots, Hkv, D * lane / 8], 2- or 4-bit lanes"
    assert layer.k_signs is None or layer.k_signs.shape[2] == d // 8, "signs [slots, Hkv, D / 8]"
    qf = q.float()
    q_rot = (qf @ layer.rot.T).contiguous()  # fp32 and contiguous: the kernels index it as [n, Hq, D]
    if layer.proj is None:
        qjl, m = [q_rot, layer.k_codes, layer.k_norm], 1
    else:
        assert layer.k_signs is not None and layer.k_rnorm is not None
        qjl, m = [(qf @ layer.proj.T).contiguous(), layer.k_signs, layer.k_rnorm], layer.proj.shape[0]
    tensors = [
        q_rot,
        qjl[0],
        layer.k_codes,
        layer.v_codes,
        layer.k_norm,
        layer.v_norm,
        qjl[1],
        qjl[2],
        layer.unit_levels,
    ]
    return tensors, [scale, scale * math.sqrt(math.pi / 2) / m]


def decode_attention(
    q: torch.Tensor,
    layer: Layer,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    block: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """TurboQuant decode: one Triton kernel over the batch between torch's rotations and the splits' merge, no host
    sync (fixed grid, loop bounds from ``seq_lens`` on the device). ``q`` ``[bs, Hq, D]`` -> ``[bs, Hq, D]``
    (an empty row gives 0). ``splits``: :func:`decode_splits` of the batch and the rows' width by default (static
    shapes: the grid a CUDA graph captures stays valid); ``block`` (positions an iteration) and ``warps``, for
    timing other choices."""
    bs, hq, d = q.shape
    if bs == 0:
        return torch.empty_like(q)
    hkv, lane = layer.k_codes.shape[1], layer.k_codes.shape[2] * 8 // d
    g = hq // hkv
    if splits is None:  # per-token norms, no per-page scale: only the split count changes here (see kivi_attention)
        splits = decode_splits(bs * hkv, req_to_token.shape[1])
    tensors, scalars = _inputs(q, layer, scale)
    ws_m, ws_l, ws_acc = split_workspace(bs * hkv, splits, g, d, q.device)
    _decode_kernel[(bs * hkv, splits)](
        *tensors,
        req_to_token,
        req_pool_indices,
        seq_lens,
        ws_m,
        ws_l,
        ws_acc,
        req_to_token.stride(0),
        *scalars,
        HKV=hkv,
        G=g,
        GP=triton.next_power_of_2(g),  # Triton pads a dot's rows to 16 itself; the per-block work scales with GP
        D=d,
        LANE=lane,
        NLEV=layer.unit_levels.numel(),
        QJL=layer.proj is not None,
        BLOCK=block or (32 if q.is_cuda else 16),
        NSPLIT=splits,
        # 4 warps: 96 registers at Llama-3-8B heads (2 warps: 168, for 7% fewer instructions an element in the
        # compiled loop; KIVI's 2 warps save 30% there).
        num_warps=warps or 4,
    )
    return merge_splits(ws_m, ws_l, ws_acc, bs, q.dtype, basis=layer.rot.T)  # out = merged @ rot


def prefix_attention(
    q: torch.Tensor,
    layer: Layer,
    qo_indptr: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    extend_lens: list[int],
    block_m: int,
    block_n: int = 32,
    prefix_lens_host: list[int] | None = None,
    ws_tokens: int = WS_TOKENS,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant extend over the cached prefix: ``q`` ``[n, Hq, D]`` (request ``i``'s rows from ``qo_indptr[i]``)
    over the first ``prefix_lens[i]`` positions of its row -> (output, fp32 natural log-sum-exp ``[n, Hq]``,
    ``-inf`` over an empty prefix). ``extend_lens``: each request's new tokens (host); ``prefix_lens_host``: the
    prefix lengths on the host if the caller has them; ``blocks``: ``fp8_attention.prefix_blocks(extend_lens,
    block_m)`` if the caller keeps them for the step (used when one pass holds every prefix)."""
    n, hq, d = q.shape
    lse = torch.full((n, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 0:
        return torch.zeros_like(q), lse
    hkv, lane = layer.k_codes.shape[1], layer.k_codes.shape[2] * 8 // d
    g = hq // hkv
    qjl = layer.proj is not None
    tensors, scalars = _inputs(q, layer, scale)
    q_rot, q_proj, pool = tensors[0], tensors[1], tensors[2:]
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)  # in the rotated basis until the end
    lens = prefix_lens_host if prefix_lens_host is not None else prefix_lens.tolist()
    passes = prefix_passes(lens, ws_tokens)
    for members in passes:
        ws_start, at = pass_starts(lens, members, q.device)
        wk = torch.empty(at, hkv, d, dtype=torch.float32, device=q.device)
        wv = torch.empty_like(wk)
        wj = torch.empty_like(wk) if qjl else wk  # never read without QJL
        _dequant_kernel[(len(lens), hkv, triton.cdiv(max(lens[i] for i in members), DEQUANT_BLOCK))](
            *pool, req_to_token, req_pool_indices, prefix_lens, ws_start, wk, wv, wj, req_to_token.stride(0),
            HKV=hkv, D=d, LANE=lane, QJL=qjl, BLOCK=DEQUANT_BLOCK)
        if blocks is not None and len(passes) == 1:
            blk_req, blk_start = blocks  # requests without a prefix read nothing (their prefix length is 0)
        else:
            chosen = set(members)
            blk_req, blk_start = fp8_attention.prefix_blocks(
                [m if i in chosen else 0 for i, m in enumerate(extend_lens)], block_m, q.device)
        if not blk_req.numel():
            continue
        _prefix_kernel[(blk_req.shape[0], hkv)](
            q_rot, q_proj, wk, wv, wj, qo_indptr, prefix_lens, ws_start, blk_req, blk_start, out, lse, *scalars,
            HKV=hkv, G=g, GP=triton.next_power_of_2(g), D=d, QJL=qjl, BLOCK_M=block_m, BLOCK_N=block_n)
    return (out @ layer.rot).to(q.dtype), lse
