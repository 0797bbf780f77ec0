"""Palu's decode attention over low-rank latents (:class:`~sgl_sparse.methods.compression.palu.PaluStore`), one
Triton kernel over the batch: per tile of a row's tokens it reconstructs each key from its latent (``z @ B^T``),
rotates it at the token's stored position, scores it against the KV head's queries and accumulates the
probabilities times the *value latents* (online softmax, split over the row like the quantized stores' kernels).
The value basis is applied once per query head after the splits merge, not per token. No host sync, fixed shapes:
it runs inside SGLang's decode CUDA graph. Two forms of the loop: queries as the dots' rows (:func:`_decode_kernel`)
and keys as the rows (:func:`_decode_kernel_key_rows`, served on CUDA: fewer shared-memory trips, deeper pipelines;
BENCHMARKS.md has both's times).

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

# How a tile's keys get their rotation (Tile.angles): each by its position (a table row a position, gathered from
# all over the table); by its offset from the tile's smallest position; by its offset from the tile's first row index;
# by its row index taken as its position (BY_ROW: no position gather, the table's rows read in order; exact only for
# rows whose positions are their indices, as a request's that no eviction, prune or Chain Cache turn compacted:
# a measurement of what the position gather costs, not served); by its row index where every position of the tile
# is its row index, else by position (ROW_CHECKED: the table's rows in order, issued with the slots; a tile whose
# positions are not its row indices gathers again; exact for any positions); by a split check (SPLIT_CHECKED, the
# keys-as-rows loop only: a split whose positions are its row indices turns each key by its offset in the tile from a
# table held in registers and the queries back by the tile's first index, so a tile's only loads are its slots and
# latents; any other split takes BY_POSITION's loop).
BY_POSITION, BY_TILE, BY_INDEX, BY_ROW, ROW_CHECKED, SPLIT_CHECKED = 0, 1, 2, 3, 4, 5
# SPLIT_CHECKED's loop for splits whose positions are not their indices: at most this many stages (its tiles also
# stage rotary rows, twice the shared memory a stage of the split-checked loop takes)
GATHER_STAGES = 5


@triton.jit
def _masked_rank(ptrs, in_rank, R: tl.constexpr, RP: tl.constexpr):
    """Latents at ``ptrs``, the rank's padding to ``RP`` (``in_rank`` false there) read as 0: masked only if any."""
    if R == RP:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=in_rank, other=0.0)


@triton.jit
def _tile(row_ptr, zk_g, pos_buf, start, o, hi, rk, stride_zks, RK: tl.constexpr, RKP: tl.constexpr,
          I32: tl.constexpr, ANGLES: tl.constexpr):
    """A tile's positions ``start + o`` of the split ending at ``hi``: which are in it, their slots (int32 offsets
    when every offset into the pool fits), key latents ``[BLOCK, RKP]``, stored positions, and the position p0
    :func:`_angles` turns the queries back by: the smallest of the tile's positions (``BY_TILE``; every tile holds
    at least one), the tile's first row index ``start`` (``BY_INDEX``), else 0; for ``ROW_CHECKED`` in its place
    the tile's row indices ``[BLOCK]``; ``BY_ROW`` takes the row indices as the positions."""
    p = start + o
    ok = p < hi
    # A position past the split reads slot 0 (a pool slot like any, finite) and scores -inf: only the slot's own
    # load, which may pass the row's end, and a rank padded to a power of two need masks.
    slot = tl.load(row_ptr + p, mask=ok, other=0).to(tl.int32 if I32 else tl.int64)
    z = _masked_rank(zk_g + slot[:, None] * stride_zks + rk[None, :], (rk < RK)[None, :], RK, RKP)
    if ANGLES == 3:
        tp = p.to(slot.dtype)
    else:
        tp = tl.load(pos_buf + slot).to(slot.dtype)
    if ANGLES == 1:
        tp0 = tl.min(tl.where(ok, tp, 2**30), 0)
    elif ANGLES == 2:
        tp0 = start
    elif ANGLES == 4:
        tp0 = p.to(slot.dtype)
    else:
        tp0 = 0
    return ok, slot, z, tp, tp0


@triton.jit
def _angles(cos_sin, tp, tp0, ok, j, stride_cs, HALF: tl.constexpr, ANGLES: tl.constexpr):
    """The rotation of a tile's keys and queries for frequencies ``j``: cos and sin ``[BLOCK, J]`` fp32 that rotate
    each key, and ``[J]`` that rotate the queries back. ``BY_POSITION`` (0): each key turns by its position (a table
    row gathered a position: rows all over the table, 256 bytes a token and head at fp16, as many as the latents)
    and the queries not at all. Otherwise each key turns by its offset t from p0 (:func:`_tile`) and the queries
    back by p0, q.R(p0 + t)k = (R(p0)^T q).(R(t)k): a tile of consecutive positions reads the table's first rows,
    the same every tile, cached near the SM. ``BY_INDEX`` takes p0 without a reduction over the tile; a position
    before its row index (none that SGLang or a method writes: eviction and pruning only drop tokens) reads the
    table's rows before position 0 (:func:`mirrored`). Exact for any positions: rows with gaps just read farther
    rows."""
    if ANGLES == 4:
        # tp0: the tile's row indices; their rows of the table depend on no load, so the pipeline issues them with
        # the slots, a level before the positions arrive
        c0 = tl.full(j.shape, 1.0, tl.float32)
        s0 = tl.zeros(j.shape, tl.float32)
        cs = cos_sin + tl.where(ok, tp0, 0)[:, None] * stride_cs + j[None, :]
        cos = tl.load(cs)
        sin = tl.load(cs + HALF)
        if tl.max(tl.where(ok & (tp != tp0), 1, 0), 0) != 0:
            cs = cos_sin + tp[:, None] * stride_cs + j[None, :]
            cos = tl.load(cs)
            sin = tl.load(cs + HALF)
        return cos.to(tl.float32), sin.to(tl.float32), c0, s0
    if ANGLES == 0 or ANGLES == 3:
        row = tl.where(ok, tp, 0) if ANGLES == 3 else tp  # a stored position: a row of the table
        c0 = tl.full(j.shape, 1.0, tl.float32)
        s0 = tl.zeros(j.shape, tl.float32)
    else:
        row = tl.where(ok, tp - tp0, 0)
        c0 = tl.load(cos_sin + tp0 * stride_cs + j).to(tl.float32)
        s0 = tl.load(cos_sin + tp0 * stride_cs + HALF + j).to(tl.float32)
    cs = cos_sin + row[:, None] * stride_cs + j[None, :]
    return tl.load(cs).to(tl.float32), tl.load(cs + HALF).to(tl.float32), c0, s0


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
    zk_g = zk + grp * stride_zkg
    zv_g = zv + grp * stride_zvg
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, RVP], tl.float32)
    o = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        ok, slot, z, tp, tp0 = _tile(row_ptr, zk_g, pos_buf, start, o, hi, rk, stride_zks, RK, RKP, I32, ANGLES)
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
            cos, sin, c0, s0 = _angles(cos_sin, tp, tp0, ok, j, stride_cs, HALF, ANGLES)
            r1 = (k1 * cos - k2 * sin).to(dt)
            r2 = (k2 * cos + k1 * sin).to(dt)
            q1 = tl.load(qrow + d1[None, :], mask=(gi < G)[:, None], other=0.0).to(tl.float32)
            q2 = tl.load(qrow + d2[None, :], mask=(gi < G)[:, None], other=0.0).to(tl.float32)
            if ANGLES == 1 or ANGLES == 2:
                q1, q2 = q1 * c0[None, :] + q2 * s0[None, :], q2 * c0[None, :] - q1 * s0[None, :]
            logits += tl.dot(q1.to(dt), tl.trans(r1)) + tl.dot(q2.to(dt), tl.trans(r2))
        logits = tl.where(ok[None, :], logits * scale, float("-inf"))
        zvt = _masked_rank(zv_g + slot[:, None] * stride_zvs + rv[None, :], (rv < RV)[None, :], RV, RVP)
        m, den, p, alpha = softmax_step(m, den, logits)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), zvt.to(dt))
    store_split(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, RVP)


@triton.jit
def _basis_queries(base, qcol, rk, gi, j0, stride_bkd, RK: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                   NEOX: tl.constexpr, JC: tl.constexpr):
    """The key basis ``[RKP, JC]`` of frequencies ``j0 .. j0 + JC`` for both dimensions each pair mixes, and the
    queries ``[JC, GP]`` fp32 at those dimensions."""
    j = j0 + tl.arange(0, JC)
    d1 = j if NEOX else 2 * j
    d2 = j + HALF if NEOX else 2 * j + 1
    b1 = tl.load(base + d1[None, :] * stride_bkd + rk[:, None], mask=(rk < RK)[:, None], other=0.0)
    b2 = tl.load(base + d2[None, :] * stride_bkd + rk[:, None], mask=(rk < RK)[:, None], other=0.0)
    q1 = tl.load(qcol + d1[:, None], mask=(gi < G)[None, :], other=0.0).to(tl.float32)
    q2 = tl.load(qcol + d2[:, None], mask=(gi < G)[None, :], other=0.0).to(tl.float32)
    return b1, b2, q1, q2


@triton.jit
def _key_scores(z, b1, b2, q1, q2, cos_sin, tp, tp0, ok, j0, stride_cs, HALF: tl.constexpr, ANGLES: tl.constexpr,
                JC: tl.constexpr, dt: tl.constexpr):
    """A tile's scores ``[BLOCK, GP]`` over the frequencies ``j0 .. j0 + JC``: the keys reconstructed there from
    their latents ``z``, rotated, dotted with the queries (turned back by p0 unless ``BY_POSITION``)."""
    k1 = tl.dot(z.to(b1.dtype), b1)  # [BLOCK, JC] fp32: each pair's first dimension, before RoPE
    k2 = tl.dot(z.to(b2.dtype), b2)
    cos, sin, c0, s0 = _angles(cos_sin, tp, tp0, ok, j0 + tl.arange(0, JC), stride_cs, HALF, ANGLES)
    if ANGLES == 1 or ANGLES == 2:
        qr1, qr2 = _queries_back(q1, q2, c0, s0, dt)
    else:
        qr1, qr2 = q1.to(dt), q2.to(dt)
    return _rotated_scores(k1, k2, qr1, qr2, cos, sin, dt)


@triton.jit
def _queries_back(q1, q2, c0, s0, dt: tl.constexpr):
    """Queries ``[JC, GP]`` at a pair's two dimensions turned back by the angles ``c0``, ``s0`` ``[JC]``, in ``dt``."""
    return (q1 * c0[:, None] + q2 * s0[:, None]).to(dt), (q2 * c0[:, None] - q1 * s0[:, None]).to(dt)


@triton.jit
def _rotated_scores(k1, k2, qr1, qr2, cos, sin, dt: tl.constexpr):
    """Scores ``[BLOCK, GP]``: keys ``k1``/``k2`` (each pair's two dimensions, ``[BLOCK, JC]``) turned by
    ``cos``/``sin``, dotted with the queries ``qr1``/``qr2``."""
    r1 = (k1 * cos - k2 * sin).to(dt)
    r2 = (k2 * cos + k1 * sin).to(dt)
    return tl.dot(r1, qr1) + tl.dot(r2, qr2)


@triton.jit
def _split_at_indices(row_ptr, pos_buf, lo, hi, I32: tl.constexpr):
    """Whether the split ``[lo, hi)`` holds positions and every one is its row index: its first and last are, and a
    row's positions strictly increase (a row is its sequence with tokens dropped, never reordered: eviction keeps
    its positions sorted, pruning drops ranges), so every one between is too. An empty split is not (it then skips
    loading the register table for a loop that does not run)."""
    has = lo < hi
    first = tl.load(pos_buf + tl.load(row_ptr + lo, mask=has, other=0).to(tl.int32 if I32 else tl.int64))
    last = tl.load(pos_buf + tl.load(row_ptr + hi - 1, mask=has, other=0).to(tl.int32 if I32 else tl.int64))
    return has & (first == lo) & (last == hi - 1)


@triton.jit
def _accumulate(logits, ok, slot, zv_g, rv, stride_zvs, scale, m, den, acc, RV: tl.constexpr, RVP: tl.constexpr,
                dt: tl.constexpr):
    """A tile's scores ``[BLOCK, GP]`` (``ok`` its positions in the split) into the keys-as-rows loop's online softmax
    and value-latent accumulator ``[RVP, GP]``: ``(m, den, acc)``."""
    logits = tl.where(ok[:, None], logits * scale, float("-inf"))
    zvt = _masked_rank(zv_g + slot[None, :] * stride_zvs + rv[:, None], (rv < RV)[:, None], RV, RVP)  # [RVP, BLOCK]
    m, den, pr, alpha = softmax_step(m, den, logits, 0)
    return m, den, acc * alpha[None, :] + tl.dot(zvt.to(dt), pr.to(dt))


@triton.jit
def _decode_kernel_key_rows(q, zk, zv, pos_buf, bk, cos_sin, req_to_token, req_pool_indices, seq_lens, ws_m, ws_l,
                            ws_acc, stride_qb, stride_qh, stride_zks, stride_zkg, stride_zvs, stride_zvg, stride_bkg,
                            stride_bkd, stride_cs, stride_r2t, scale, HKV: tl.constexpr, GS: tl.constexpr,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                            NEOX: tl.constexpr, RK: tl.constexpr, RKP: tl.constexpr, RV: tl.constexpr,
                            RVP: tl.constexpr, BLOCK: tl.constexpr, NSPLIT: tl.constexpr, NATIVE: tl.constexpr,
                            I32: tl.constexpr, ANGLES: tl.constexpr, JC: tl.constexpr, GSTAGES: tl.constexpr):
    """:func:`_decode_kernel` with the tile's keys as the rows of every dot: the rotated keys, an accumulator
    ``[BLOCK, HALF]``, feed the score dot as its left operand (``[BLOCK, HALF] @ [HALF, GP]``), which the tensor
    cores read from registers, instead of its right one, which passes through shared memory transposed; the value
    latents accumulate as ``[RV, GP]``. The basis and the queries, the same for every tile, are loaded once."""
    rh, pid, i, h, _, lo, hi = split_span(seq_lens, HKV, BLOCK, NSPLIT)
    grp = h // GS
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    dt = q.dtype.element_ty if NATIVE else tl.float32
    rk = tl.arange(0, RKP)
    rv = tl.arange(0, RVP)
    gi = tl.arange(0, GP)
    base = bk + grp * stride_bkg + ((h % GS) * D).to(tl.int64) * stride_bkd
    qcol = q + i * stride_qb + (h * G + gi)[None, :] * stride_qh
    # the basis and the queries of the frequencies' first chunk (all of them when JC == HALF) and of the second
    b1a, b2a, q1a, q2a = _basis_queries(base, qcol, rk, gi, 0, stride_bkd, RK, G, HALF, NEOX, JC)
    b1b, b2b, q1b, q2b = _basis_queries(base, qcol, rk, gi, JC % HALF, stride_bkd, RK, G, HALF, NEOX, JC)
    zk_g = zk + grp * stride_zkg
    zv_g = zv + grp * stride_zvg
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([RVP, GP], tl.float32)
    o = tl.arange(0, BLOCK)
    at_indices = False
    if ANGLES == 5:
        at_indices = _split_at_indices(row_ptr, pos_buf, lo, hi, I32)
    if at_indices:
        # R(start + o) = R(start) R(o): the keys turn by their offset o in the tile, from rows 0 .. BLOCK - 1 of the
        # table held in registers, the queries back by the tile's first index, a row read with no gather
        ja = tl.arange(0, JC)
        jb = JC % HALF + ja
        cta = tl.load(cos_sin + o[:, None] * stride_cs + ja[None, :]).to(tl.float32)
        sta = tl.load(cos_sin + o[:, None] * stride_cs + HALF + ja[None, :]).to(tl.float32)
        ctb = tl.load(cos_sin + o[:, None] * stride_cs + jb[None, :]).to(tl.float32)
        stb = tl.load(cos_sin + o[:, None] * stride_cs + HALF + jb[None, :]).to(tl.float32)
        for start in range(lo, hi, BLOCK):
            # angles 3 (BY_ROW): slots and latents only, no position load
            ok, slot, z, at_p, at_p0 = _tile(row_ptr, zk_g, pos_buf, start, o, hi, rk, stride_zks, RK, RKP, I32, 3)
            row0 = cos_sin + start * stride_cs
            qr1, qr2 = _queries_back(q1a, q2a, tl.load(row0 + ja).to(tl.float32),
                                     tl.load(row0 + HALF + ja).to(tl.float32), dt)
            logits = _rotated_scores(tl.dot(z.to(b1a.dtype), b1a), tl.dot(z.to(b2a.dtype), b2a), qr1, qr2, cta, sta, dt)
            if JC < HALF:
                qr1, qr2 = _queries_back(q1b, q2b, tl.load(row0 + jb).to(tl.float32),
                                         tl.load(row0 + HALF + jb).to(tl.float32), dt)
                logits += _rotated_scores(tl.dot(z.to(b1b.dtype), b1b), tl.dot(z.to(b2b.dtype), b2b), qr1, qr2, ctb,
                                          stb, dt)
            m, den, acc = _accumulate(logits, ok, slot, zv_g, rv, stride_zvs, scale, m, den, acc, RV, RVP, dt)
    else:
        # SPLIT_CHECKED's other splits take BY_POSITION's loop, at fewer stages (GSTAGES)
        A: tl.constexpr = 0 if ANGLES == 5 else ANGLES
        for start in tl.range(lo, hi, BLOCK, num_stages=GSTAGES):
            ok, slot, z, tp, tp0 = _tile(row_ptr, zk_g, pos_buf, start, o, hi, rk, stride_zks, RK, RKP, I32, A)
            logits = _key_scores(z, b1a, b2a, q1a, q2a, cos_sin, tp, tp0, ok, 0, stride_cs, HALF, A, JC, dt)
            if JC < HALF:
                logits += _key_scores(z, b1b, b2b, q1b, q2b, cos_sin, tp, tp0, ok, JC, stride_cs, HALF, A, JC, dt)
            m, den, acc = _accumulate(logits, ok, slot, zv_g, rv, stride_zvs, scale, m, den, acc, RV, RVP, dt)
    store_split(ws_m, ws_l, ws_acc, rh, pid, m, den, tl.trans(acc), NSPLIT, G, GP, RVP)


INT32_LIMIT = 2**31


class Tile(NamedTuple):
    """A decode tile: ``block`` positions an iteration, ``warps``, pipeline ``stages``, ``maxnreg`` registers a thread
    at most (more blocks an SM; 0: no cap), ``freq_chunk`` rotary frequencies reconstructed at a time (a power of
    two >= 16 dividing ``D / 2``: fewer live registers for the same work; 0: all), ``query_rows`` (the group's
    query heads padded to this power of two), ``angles`` (``BY_POSITION``, ``BY_TILE``, ``BY_INDEX``, ``BY_ROW``,
    ``ROW_CHECKED`` or ``SPLIT_CHECKED``: how a key gets its rotation, :func:`_angles`), ``key_rows``
    (:func:`_decode_kernel_key_rows`; the frequencies in one chunk or two), ``splits`` (split-KV programs a row;
    0: ``decode_splits`` of the shapes)."""

    block: int
    warps: int = 4
    stages: int = 3
    maxnreg: int = 0
    freq_chunk: int = 0
    query_rows: int = 16
    angles: int = BY_POSITION
    key_rows: bool = False
    splits: int = 0


def check_tile(tile: Tile, head_dim: int | None = None) -> None:
    """ValueError unless the kernel runs ``tile`` (for heads of ``head_dim`` dimensions, a power of two, if given)."""
    if tile.angles not in (BY_POSITION, BY_TILE, BY_INDEX, BY_ROW, ROW_CHECKED, SPLIT_CHECKED):
        raise ValueError(f"angles {tile.angles}: {BY_POSITION} to {SPLIT_CHECKED}")
    if tile.angles == SPLIT_CHECKED and not tile.key_rows:
        raise ValueError(f"angles {SPLIT_CHECKED} (a split check): the keys-as-rows loop only (key_rows)")
    if tile.block < 16 or tile.block & (tile.block - 1) or tile.warps & (tile.warps - 1):
        raise ValueError(f"block {tile.block}, warps {tile.warps}: powers of two, a block of 16 or more")
    if tile.query_rows & (tile.query_rows - 1):
        raise ValueError(f"query_rows {tile.query_rows}: a power of two")
    if tile.splits < 0:
        raise ValueError(f"splits {tile.splits}: 0 (the shapes' default) or more")
    if head_dim is None:
        return
    half = head_dim // 2
    jc = tile.freq_chunk or half
    if not (jc >= 16 and half % jc == 0 and jc & (jc - 1) == 0):
        raise ValueError(f"freq_chunk {jc}: a power of two >= 16 dividing {half}")
    if tile.key_rows and jc not in (half, half // 2):
        raise ValueError(f"freq_chunk {jc}: key_rows reconstructs the frequencies in one or two chunks")


def parse_tile(spec: str) -> Tile:
    """``BLOCKxWARPSxSTAGES[xMAXNREG[xCHUNK[xROWS[xANGLES[xKEYROWS[xSPLITS]]]]]]`` (0: the field's default) as a
    Tile, the form ``quant_decode.py --palu-tiles`` and Palu's ``decode_tile`` take; ValueError naming the fields."""
    names = Tile._fields
    try:
        fields = [int(x) for x in spec.split("x")]
    except ValueError:
        fields = []
    if not 3 <= len(fields) <= len(names) or fields[0] <= 0 or min(fields) < 0:
        raise ValueError(f"{spec!r}: 3 to {len(names)} non-negative integers joined by 'x', {'x'.join(names)}")
    default = Tile(block=fields[0])
    given: dict[str, int | bool] = {k: (bool(v) if isinstance(getattr(default, k), bool) else v)
                                    for k, v in zip(names, fields) if v}
    tile = default._replace(**given)  # type: ignore[arg-type]  # each field's own type, as given
    check_tile(tile)
    return tile


# The GPU's tile by the rank padded to a power of two (cuda_tile); benchmarks/quant_decode.py's sweeps chose them.
CUDA_TILES: dict[int, Tile] = {64: Tile(64, stages=5, query_rows=8, key_rows=True),
                               128: Tile(128, warps=8, stages=4, query_rows=8, key_rows=True)}
CPU_TILE = Tile(block=16)


def cuda_tile(rank: int) -> Tile:
    """The served tile of a rank padded to a power of two: the smallest rank's tile that covers it."""
    return next((t for r, t in sorted(CUDA_TILES.items()) if r >= rank), CUDA_TILES[max(CUDA_TILES)])


def gather_stages(tile: Tile) -> int:
    """The stages of the keys-as-rows loop that gathers rotary rows by position: the tile's, at most
    ``GATHER_STAGES`` where it is ``SPLIT_CHECKED``'s loop for splits not at their indices."""
    return min(tile.stages, GATHER_STAGES) if tile.angles == SPLIT_CHECKED else tile.stages


def mirrored(cos_sin: torch.Tensor) -> torch.Tensor:
    """A rotary table ``[M, D]`` (cosines, then sines) as a view from its position 0 into ``[2M - 1, D]`` whose
    rows before it hold positions ``-1 .. -(M - 1)`` (cosines even, sines odd): the table ``BY_INDEX`` reads, where
    a position before its row index turns by a negative offset."""
    half = cos_sin.shape[1] // 2
    neg = cos_sin[1:].flip(0).clone()
    neg[:, half:] = -neg[:, half:]
    return torch.cat([neg, cos_sin])[cos_sin.shape[0] - 1:]


def table_for(tile: Tile, cos_sin: torch.Tensor) -> torch.Tensor:
    """The rotary table ``tile`` reads: :func:`mirrored` where its angles go by row index (``BY_INDEX``), else
    ``cos_sin`` itself."""
    return mirrored(cos_sin) if tile.angles == BY_INDEX else cos_sin


def decode_attention(q: torch.Tensor, zk: torch.Tensor, zv: torch.Tensor, positions: torch.Tensor,
                     k_basis: torch.Tensor, v_basis: torch.Tensor, cos_sin: torch.Tensor, neox: bool,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     splits: int | None = None, tile: Tile | None = None, native: bool | None = None) -> torch.Tensor:
    """Decode attention over one layer's latents: ``q`` ``[bs, Hq, D]``; ``zk``/``zv`` ``[slots, groups, r]``,
    ``positions`` ``[slots]`` int32; ``k_basis``/``v_basis`` ``[groups, group_size * D, r]``; ``cos_sin`` the
    rotary table ``[max_pos, D]`` (the whole head rotated; fp32 or fp16; :func:`mirrored` for ``BY_INDEX``) ->
    ``[bs, Hq, D]`` in ``q``'s dtype.
    ``tile``: default :data:`CUDA_TILES` by rank on the GPU (benchmarks/quant_decode.py sweeps others), else
    :data:`CPU_TILE`; ``native``: dots in the model dtype (default: on the GPU)."""
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
    if tile is None:
        tile = cuda_tile(rkp) if q.is_cuda else CPU_TILE
    check_tile(tile, d)
    jc = tile.freq_chunk or half
    assert tile.angles != SPLIT_CHECKED or cos_sin.shape[0] >= tile.block, "a rotary row for each offset in a tile"
    assert tile.angles != BY_INDEX or cos_sin.storage_offset() >= (cos_sin.shape[0] - 1) * cos_sin.stride(0), \
        "BY_INDEX reads the rows before position 0: pass mirrored(table)"
    g = hq // hkv
    rvp = triton.next_power_of_2(rv)
    gp = max(tile.query_rows, triton.next_power_of_2(g))
    if splits is None:
        splits = tile.splits or decode_splits(bs * hkv, req_to_token.shape[1])
    ws_m, ws_l, ws_acc = split_workspace(bs * hkv, splits, g, rvp, q.device)
    # every offset a program computes from a slot or a position lies inside one of these tensors
    i32 = max(zk.numel(), zv.numel(), cos_sin.numel(), positions.numel()) < INT32_LIMIT
    kernel = _decode_kernel_key_rows if tile.key_rows else _decode_kernel
    kernel[(bs * hkv, splits)](
        q, zk, zv, positions, k_basis, cos_sin, req_to_token, req_pool_indices, seq_lens, ws_m, ws_l, ws_acc,
        q.stride(0), q.stride(1), zk.stride(0), zk.stride(1), zv.stride(0), zv.stride(1), k_basis.stride(0),
        k_basis.stride(1), cos_sin.stride(0), req_to_token.stride(0), scale, HKV=hkv, GS=gs, G=g, GP=gp, D=d,
        HALF=half, NEOX=neox, RK=rk, RKP=rkp, RV=rv, RVP=rvp, BLOCK=tile.block, NSPLIT=splits,
        NATIVE=q.is_cuda if native is None else native, I32=i32, ANGLES=tile.angles, JC=jc, num_warps=tile.warps,
        num_stages=tile.stages, **({"GSTAGES": gather_stages(tile)} if tile.key_rows else {}),
        **({"maxnreg": tile.maxnreg} if tile.maxnreg else {}))
    return merge_splits(ws_m, ws_l, ws_acc, bs, q.dtype, basis=v_basis, basis_heads=gs)
