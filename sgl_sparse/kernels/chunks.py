"""Reading chunk-major packed codes (``kernels/quant.py::pack_chunks``) in Triton: KIVI's and TurboQuant's layout.

A vector of ``D`` codes of ``LANE`` bits (1, 2 or 4) is ``W = D / P`` bytes, ``P = 8 / LANE``; byte ``j`` holds
the code of channel ``c * W + j`` in its bits ``[c * LANE, (c + 1) * LANE)``. A kernel loads a ``[BLOCK, W]``
byte tile once (contiguous per slot) and takes chunk ``c`` from it with a mask: the tile of channels
``[c W, (c + 1) W)``, already in channel order (no reshape). It works on ``P`` chunks (``[rows, W]`` tiles, kept
in tuples) instead of ``[rows, D]`` tiles:

* :func:`code_tile` loads a byte tile (uint8), :func:`code_bytes` the same as int32; :func:`chunks_16` turns every
  chunk of a tile into 16-bit floats ``OFFSET + code * unit`` for the tensor cores, in PTX on the GPU (a ``prmt``
  per 4 bytes, a ``lop3`` per 2 codes: KIVI's decode); :func:`chunk_float` chunk ``c`` into exact fp32 codes with
  an AND and a float add an element, after one OR a byte for all its chunks (the int -> float convert is slower);
  :func:`chunk_code` into integer codes (a shift and a mask) for a codebook gather;
* :func:`query_chunks` splits the queries into the same chunks once per program, :func:`dot_nt` is the logits
  of one chunk, :func:`store_split_chunks` stores the split state from ``[GP, U]`` pieces of the output. With
  ``T`` they (and :func:`code_tile`, :func:`zero_pieces`) take the transposed tiles of a keys-as-rows kernel
  (KIVI's ``_decode_kernel_key_rows``: the keys ``[BLOCK, W]`` as the dots' left operand), :func:`dot_nn` its
  logits.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp32 2**23: OR'd into an integer below 2**23, the bits are 2**23 + that integer (exact), so a bitcast and a
# subtraction of 2**23 make it a float without the int -> float conversion.
MAGIC = tl.constexpr(0x4B000000)
EXPONENT = tl.constexpr(-8388608)  # 0xFF800000 as int32: sign and exponent bits, kept by chunk_float's mask


@triton.jit
def code_tile(codes, slot, h, stride_cs, stride_ch, ok, col0, BLOCK: tl.constexpr, U: tl.constexpr,
              T: tl.constexpr = False):
    """uint8 ``[BLOCK, U]``: bytes ``col0 .. col0 + U`` of the packed vector at ``slot`` x KV head ``h`` (rows not
    ``ok`` read 0); ``T``: ``[U, BLOCK]``, loaded so (a slot's bytes down a column, still contiguous), not
    transposed after."""
    u = tl.arange(0, U)
    if T:
        off = slot.to(tl.int64)[None, :] * stride_cs + h * stride_ch + col0 + u[:, None]
        return tl.load(codes + off, mask=ok[None, :], other=0)
    else:
        off = slot.to(tl.int64)[:, None] * stride_cs + h * stride_ch + col0 + u[None, :]
        return tl.load(codes + off, mask=ok[:, None], other=0)


@triton.jit
def code_bytes(codes, slot, h, stride_cs, stride_ch, ok, col0, BLOCK: tl.constexpr, U: tl.constexpr):
    """:func:`code_tile` as int32."""
    return code_tile(codes, slot, h, stride_cs, stride_ch, ok, col0, BLOCK, U).to(tl.int32)


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
                 P: tl.constexpr, T: tl.constexpr = False):
    """Request ``i``'s queries of KV head ``h``'s group times ``scale``, as ``P`` chunks ``[GP, W]`` fp32 (chunk
    ``c`` is channels ``[c W, (c + 1) W)``; rows past ``G`` are 0); ``T``: as ``[W, GP]`` (the right operand of
    a keys-as-rows dot)."""
    gi = tl.arange(0, GP)
    j = tl.arange(0, W)
    if T:
        base = q + i * stride_qb + (h * G + gi)[None, :] * stride_qh + j[:, None]
        gm = (gi < G)[None, :]
    else:
        base = q + i * stride_qb + (h * G + gi)[:, None] * stride_qh + j[None, :]
        gm = (gi < G)[:, None]
    out = ()
    for c in tl.static_range(P):
        out = out + (tl.load(base + c * W, mask=gm, other=0.0).to(tl.float32) * scale,)
    return out


@triton.jit
def dot_nt(a, b):
    """``a`` ``[M, K]`` times ``b`` ``[N, K]`` transposed, fp32: ``tl.dot`` (the tensor cores) where ``K >= 16``,
    which it needs on a GPU; a broadcast multiply-sum under that (a 1-bit chunk of a 64-dim head, test shapes)."""
    if a.shape[1] >= 16:
        return tl.dot(a, tl.trans(b))
    else:
        return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)


@triton.jit
def dot_nn(a, b):
    """``a`` ``[M, K]`` times ``b`` ``[K, N]``, fp32: :func:`dot_nt` without the transpose (keys-as-rows kernels,
    whose key tile is the left operand)."""
    if a.shape[1] >= 16:
        return tl.dot(a, b)
    else:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)


@triton.jit
def zero_pieces(GP: tl.constexpr, D: tl.constexpr, U: tl.constexpr, T: tl.constexpr = False):
    """An output accumulator as ``D / U`` pieces ``[GP, U]`` fp32 (piece ``k`` is channels ``[k U, (k + 1) U)``);
    ``T``: ``[U, GP]`` (a keys-as-rows kernel's)."""
    out = ()
    for _k in tl.static_range(D // U):
        if T:
            out = out + (tl.zeros([U, GP], tl.float32),)
        else:
            out = out + (tl.zeros([GP, U], tl.float32),)
    return out


@triton.jit
def store_split_chunks(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT: tl.constexpr, G: tl.constexpr,
                       GP: tl.constexpr, D: tl.constexpr, U: tl.constexpr, T: tl.constexpr = False):
    """``splits.store_split`` with the output as :func:`zero_pieces`' pieces (``T``: its ``[U, GP]`` ones), each
    stored at its channels."""
    gi = tl.arange(0, GP)
    gm = gi < G
    w = (rh.to(tl.int64) * NSPLIT + pid) * G
    tl.store(ws_m + w + gi, m, mask=gm)
    tl.store(ws_l + w + gi, den, mask=gm)
    u = tl.arange(0, U)
    for k in tl.static_range(D // U):
        if T:
            tl.store(ws_acc + (w + gi)[None, :] * D + k * U + u[:, None], acc[k], mask=gm[None, :])
        else:
            tl.store(ws_acc + (w + gi)[:, None] * D + k * U + u[None, :], acc[k], mask=gm[:, None])


def _shifted(c: int, lane: int, fp16: bool) -> bool:
    """Whether chunk ``c``'s bits reach bit 7 of the byte, past bf16's 7 mantissa bits: such a chunk is taken from the
    byte shifted right by one (fp16's 10 mantissa bits hold the whole byte)."""
    return not fp16 and (c + 1) * lane > 7


def _packed_asm(lane: int, fp16: bool) -> str:
    """PTX for :func:`chunks_16` at ``lane`` bits: 4 bytes in (``$(2 P)``), for each chunk ``c`` two 16-bit pair
    registers out (``$2c``, ``$2c+1``): bytes 0, 1 and 2, 3 spread to the two halves of a register (``prmt``, once
    for every chunk), then one ``lop3`` a register, ``(x & lane mask) | magic`` a half: the chunk's bits land in the
    mantissa of ``OFFSET`` (fp16 1024, bf16 128), so the half is exactly ``OFFSET + code * unit``."""
    p = 8 // lane
    magic = "0x64006400" if fp16 else "0x43004300"
    lines = ["{", ".reg .b32 t0, t1, u0, u1, z;", "mov.b32 z, 0;",
             f"prmt.b32 t0, ${2 * p}, z, 0x4140;", f"prmt.b32 t1, ${2 * p}, z, 0x4342;"]
    if any(_shifted(c, lane, fp16) for c in range(p)):
        lines += ["shr.b32 u0, t0, 1;", "shr.b32 u1, t1, 1;"]
    for c in range(p):
        shift = _shifted(c, lane, fp16)
        mask = (((1 << lane) - 1) << (c * lane)) >> int(shift)
        src0, src1 = ("u0", "u1") if shift else ("t0", "t1")
        lines += [f"lop3.b32 ${2 * c}, {src0}, {mask | mask << 16:#010x}, {magic}, 0xEA;",
                  f"lop3.b32 ${2 * c + 1}, {src1}, {mask | mask << 16:#010x}, {magic}, 0xEA;"]
    return "\n".join(lines + ["}"])


def _constraints(lane: int) -> str:
    return ",".join(["=r"] * (16 // lane) + ["r"])


ASM_BF16_4, ASM_BF16_2, ASM_BF16_1 = (tl.constexpr(_packed_asm(n, False)) for n in (4, 2, 1))
ASM_FP16_4, ASM_FP16_2, ASM_FP16_1 = (tl.constexpr(_packed_asm(n, True)) for n in (4, 2, 1))
CONSTRAINTS_4, CONSTRAINTS_2, CONSTRAINTS_1 = (tl.constexpr(_constraints(n)) for n in (4, 2, 1))


@triton.jit
def chunk_offset(FP16: tl.constexpr):
    """What :func:`chunks_16` adds to every code (the magic number whose mantissa the code's bits fill)."""
    if FP16:
        return 1024.0
    else:
        return 128.0


@triton.jit
def chunk_unit(c: tl.constexpr, LANE: tl.constexpr, FP16: tl.constexpr):
    """``1 / unit`` of chunk ``c`` in :func:`chunks_16` (its value is ``OFFSET + code * unit``): what the caller folds
    into the scale that multiplies it."""
    if FP16 or (c + 1) * LANE <= 7:
        return 1.0 / (1 << (c * LANE))
    else:
        return 1.0 / (1 << (c * LANE - 1))


@triton.jit
def _asm(b, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, LANE: tl.constexpr, FP16: tl.constexpr):
    if FP16:
        h = tl.float16
    else:
        h = tl.bfloat16
    if LANE == 4:
        return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [b], (h, h), True, 4)
    elif LANE == 2:
        return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [b], (h, h, h, h), True, 4)
    else:
        return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [b], (h, h, h, h, h, h, h, h), True, 4)


@triton.jit
def chunks_16(b, LANE: tl.constexpr, FP16: tl.constexpr, NATIVE: tl.constexpr):
    """Every chunk of a uint8 byte tile ``b`` as ``OFFSET + code * unit`` (:func:`chunk_offset`, :func:`chunk_unit`;
    a tuple of ``8 / LANE`` tiles of ``b``'s shape), fp16 (``FP16``) or bf16, for the tensor cores: the caller folds
    ``1 / unit`` into its scale and the offset into a sum of its other operand (``x . (OFFSET + v) = x . v + OFFSET
    * sum(x)``, with the same rounded ``x``: the offset cancels in the algebra, the fp32 sums carry its magnitude).
    On the GPU 4 bytes at a time in PTX
    (:func:`_packed_asm`: ~0.75 instructions an element at 4 bits, no conversion, no float op); under
    ``TRITON_INTERPRET=1`` (no inline assembly, and no 16-bit float dots) the same values in fp32 by arithmetic."""
    if NATIVE:
        if LANE == 4:
            return _asm(b, ASM_FP16_4 if FP16 else ASM_BF16_4, CONSTRAINTS_4, 4, FP16)
        elif LANE == 2:
            return _asm(b, ASM_FP16_2 if FP16 else ASM_BF16_2, CONSTRAINTS_2, 2, FP16)
        else:
            return _asm(b, ASM_FP16_1 if FP16 else ASM_BF16_1, CONSTRAINTS_1, 1, FP16)
    else:
        x = b.to(tl.int32)
        out = ()
        for c in tl.static_range(8 // LANE):
            v = (x & (((1 << LANE) - 1) << (c * LANE))).to(tl.float32)
            out = out + (v / (chunk_unit(c, LANE, FP16) * (1 << (c * LANE))) + chunk_offset(FP16),)
        return out


def chunk_width(d: int, lane: int) -> int:
    """``W``: bytes a vector of ``d`` codes of ``lane`` bits takes (and channels a chunk)."""
    return d * lane // 8

