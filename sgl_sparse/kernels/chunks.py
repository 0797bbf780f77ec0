"""Reading chunk-major packed codes (``kernels/quant.py::pack_chunks``) in Triton: KIVI's and TurboQuant's layout.

A vector of ``D`` codes of ``LANE`` bits (1, 2 or 4) is ``W = D / P`` bytes, ``P = 8 / LANE``; byte ``j`` holds
the code of channel ``c * W + j`` in its bits ``[c * LANE, (c + 1) * LANE)``. A kernel loads a ``[BLOCK, W]``
byte tile once (contiguous per slot) and takes chunk ``c`` from it with a mask: the tile of channels
``[c W, (c + 1) W)``, already in channel order (no reshape). It works on ``P`` chunks (``[rows, W]`` tiles, kept
in tuples) instead of ``[rows, D]`` tiles:

* :func:`code_bytes` loads a byte tile; :func:`chunk_float` turns chunk ``c`` into exact fp32 codes with an AND
  and a float add an element, after one OR a byte for all its chunks (the int -> float convert is slower);
  :func:`chunk_code` into integer codes (a shift and a mask) for a codebook gather;
* :func:`query_chunks` splits the queries into the same chunks once per program, :func:`dot_nt` is the logits
  of one chunk, :func:`store_split_chunks` stores the split state from ``[GP, U]`` pieces of the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp32 2**23: OR'd into an integer below 2**23, the bits are 2**23 + that integer (exact), so a bitcast and a
# subtraction of 2**23 make it a float without the int -> float conversion.
MAGIC = tl.constexpr(0x4B000000)
EXPONENT = tl.constexpr(-8388608)  # 0xFF800000 as int32: sign and exponent bits, kept by chunk_float's mask


@triton.jit
def code_bytes(codes, slot, h, stride_cs, stride_ch, ok, col0, BLOCK: tl.constexpr, U: tl.constexpr):
    """int32 ``[BLOCK, U]``: bytes ``col0 .. col0 + U`` of the packed vector at ``slot`` x KV head ``h`` (rows not
    ``ok`` read 0)."""
    u = tl.arange(0, U)
    off = slot.to(tl.int64)[:, None] * stride_cs + h * stride_ch + col0 + u[None, :]
    return tl.load(codes + off, mask=ok[:, None], other=0).to(tl.int32)


@triton.jit
def chunk_float(bm, c: tl.constexpr, LANE: tl.constexpr):
    """Chunk ``c`` of a byte tile ``bm`` that already has :data:`MAGIC` OR'd in (once for all chunks), as fp32
    ``code * 2**(c * LANE)``, exact: the lane masked in place (with the exponent bits), bitcast, minus 2**23. So
    per element one AND and one float add; the caller folds the ``2**-(c * LANE)``."""
    x = bm & (EXPONENT | (((1 << LANE) - 1) << (c * LANE)))
    return x.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def chunk_code(b, c: tl.constexpr, LANE: tl.constexpr):
    """Chunk ``c`` of a byte tile ``b`` as int32 codes (a shift and a mask; the last chunk needs no mask)."""
    if c == 8 // LANE - 1:
        return b >> (c * LANE)
    else:
        return (b >> (c * LANE)) & ((1 << LANE) - 1)


@triton.jit
def query_chunks(q, i, h, stride_qb, stride_qh, scale, G: tl.constexpr, GP: tl.constexpr, W: tl.constexpr,
                 P: tl.constexpr):
    """Request ``i``'s queries of KV head ``h``'s group times ``scale``, as ``P`` chunks ``[GP, W]`` fp32 (chunk
    ``c`` is channels ``[c W, (c + 1) W)``; rows past ``G`` are 0)."""
    gi = tl.arange(0, GP)
    j = tl.arange(0, W)
    base = q + i * stride_qb + (h * G + gi)[:, None] * stride_qh + j[None, :]
    out = ()
    for c in tl.static_range(P):
        out = out + (tl.load(base + c * W, mask=(gi < G)[:, None], other=0.0).to(tl.float32) * scale,)
    return out


@triton.jit
def dot_nt(a, b):
    """``a`` ``[M, K]`` times ``b`` ``[N, K]`` transposed, fp32: ``tl.dot`` (the tensor cores) where ``K >= 16``,
    which it needs on a GPU; a broadcast multiply-sum under that (a 1-bit chunk of a 64-dim head, test shapes)."""
    if a.shape[1] >= 16:
        return tl.dot(a, tl.trans(b))
    else:
        return tl.sum(a[:, None, :] * b[None, :, :], 2)


@triton.jit
def zero_pieces(GP: tl.constexpr, D: tl.constexpr, U: tl.constexpr):
    """An output accumulator as ``D / U`` pieces ``[GP, U]`` fp32 (piece ``k`` is channels ``[k U, (k + 1) U)``)."""
    out = ()
    for _k in tl.static_range(D // U):
        out = out + (tl.zeros([GP, U], tl.float32),)
    return out


@triton.jit
def store_split_chunks(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT: tl.constexpr, G: tl.constexpr,
                       GP: tl.constexpr, D: tl.constexpr, U: tl.constexpr):
    """``splits.store_split`` with the output as :func:`zero_pieces`' pieces, each stored at its channels."""
    gi = tl.arange(0, GP)
    gm = gi < G
    w = (rh.to(tl.int64) * NSPLIT + pid) * G
    tl.store(ws_m + w + gi, m, mask=gm)
    tl.store(ws_l + w + gi, den, mask=gm)
    u = tl.arange(0, U)
    for k in tl.static_range(D // U):
        tl.store(ws_acc + (w + gi)[:, None] * D + k * U + u[None, :], acc[k], mask=gm[:, None])


def chunk_width(d: int, lane: int) -> int:
    """``W``: bytes a vector of ``d`` codes of ``lane`` bits takes (and channels a chunk)."""
    return d * lane // 8

