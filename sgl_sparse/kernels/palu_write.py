"""Palu's write (:meth:`~sgl_sparse.methods.compression.palu.PaluStore.write`) as one Triton kernel: each token's
post-RoPE K turned back to its pre-RoPE form at the token's position, both K and V projected onto their group's
basis (``z = x^T B``), the latents rounded to the pool dtype and stored at the token's slot with its position.

Why: the torch form (undo the rotation, two einsums, casts, three scatters) is 15 to 25 small kernels a layer,
run at every decode step inside SGLang's decode CUDA graph. Here it is one launch, with no host sync and grid and
constants fixed by the shapes alone (CUDA-graph safe).

One program per (block of 16 tokens, group) rather than per (token, group): a group's K and V bases (``g * D x r``
fp32 each, 32 KB at a 128-dim head and rank 64) are then read once per 16 tokens instead of once per token, so an
extend of thousands of tokens stays a matrix product (``tl.dot``) rather than thousands of vector-matrix ones
re-reading the bases; a decode batch of 48 tokens is 3 programs a group. The dots take fp32 operands at IEEE
precision (not TF32) and accumulate in fp32, as the torch path's fp32 einsum does; the latents are rounded to the
pool dtype once, at the store. The rotation is the torch path's arithmetic (``x1 cos + x2 sin``, ``x2 cos - x1
sin`` in fp32); only the order of the projection's sums differs (and the GPU may fuse a product into an add), so
fp32 latents agree to rounding and model-dtype ones to at most one unit in the last place (where the fp32 sums
straddle a rounding boundary).

Every dimension is rotated (``rotary_dim == head_dim``, as the store's decode kernel assumes) and the head dim
is a power of two of at least 32 (:func:`fits`); the store writes through its torch path otherwise. Slot 0, SGLang's
padding slot, is never written (the decode kernel reads it for positions past a split: it stays zero and finite).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 16  # tl.dot's smallest M
CHUNK = 32  # rotation pairs (and V dimensions) per dot: 2 x [CHUNK, r] fp32 basis tiles in registers at a time


def fits(head_dim: int) -> bool:
    """Whether the kernel takes heads of ``head_dim``: a power of two whose half is at least tl.dot's 16."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dtype``. For bf16 the bits are rounded here first: the Triton
    interpreter's plain cast truncates, and a value already in bf16 is cast exactly by both it and the GPU."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        x = ((b >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _write_kernel(k, v, positions, loc, zk, zv, pos_buf, bk, bv, cos_sin, n,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_zks, stride_zkg, stride_zvs, stride_zvg,
                  stride_bkg, stride_bkd, stride_bvg, stride_bvd, stride_cs,
                  GS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, CH: tl.constexpr, NEOX: tl.constexpr,
                  RK: tl.constexpr, RKP: tl.constexpr, RV: tl.constexpr, RVP: tl.constexpr, BT: tl.constexpr):
    blk = tl.program_id(0)
    grp = tl.program_id(1)
    t = (blk * BT + tl.arange(0, BT)).to(tl.int64)
    ok = t < n
    p = tl.load(positions + t, mask=ok, other=0).to(tl.int64)
    slot = tl.load(loc + t, mask=ok, other=0).to(tl.int64)
    rk = tl.arange(0, RKP)
    rv = tl.arange(0, RVP)
    bk_g = bk + grp * stride_bkg
    bv_g = bv + grp * stride_bvg
    acc_k = tl.zeros((BT, RKP), tl.float32)
    acc_v = tl.zeros((BT, RVP), tl.float32)
    # runtime loops: unrolled, the compiler hoisted every chunk's loads and spilled past rank 64 (sm_90, 4 warps)
    for h in range(GS):
        head = grp * GS + h
        k_row = k + t[:, None] * stride_kt + head * stride_kh
        for c in range(0, HALF, CH):
            j = c + tl.arange(0, CH)
            # the two dimensions each rotation pair mixes: (j, j + D/2) (neox) or (2j, 2j + 1)
            i1 = j if NEOX else 2 * j
            i2 = j + HALF if NEOX else 2 * j + 1
            x1 = tl.load(k_row + i1[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            x2 = tl.load(k_row + i2[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            cs = cos_sin + p[:, None] * stride_cs + j[None, :]
            cos = tl.load(cs, mask=ok[:, None], other=0.0).to(tl.float32)
            sin = tl.load(cs + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
            # the rotation's transpose, as rope.rotate(inverse=True) computes it (bar the GPU's fused multiply-adds)
            pre1 = x1 * cos + x2 * sin
            pre2 = x2 * cos - x1 * sin
            b1 = tl.load(bk_g + (h * D + i1)[:, None] * stride_bkd + rk[None, :], mask=(rk < RK)[None, :], other=0.0)
            b2 = tl.load(bk_g + (h * D + i2)[:, None] * stride_bkd + rk[None, :], mask=(rk < RK)[None, :], other=0.0)
            acc_k = tl.dot(pre1, b1, acc_k, input_precision="ieee")
            acc_k = tl.dot(pre2, b2, acc_k, input_precision="ieee")
        v_row = v + t[:, None] * stride_vt + head * stride_vh
        for c in range(0, D, CH):
            d = c + tl.arange(0, CH)
            x = tl.load(v_row + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            b = tl.load(bv_g + (h * D + d)[:, None] * stride_bvd + rv[None, :], mask=(rv < RV)[None, :], other=0.0)
            acc_v = tl.dot(x, b, acc_v, input_precision="ieee")
    # slot 0 (SGLang's padding slot, where a CUDA graph's padded rows write) is never written: it stays zero latents
    # at position 0, which the decode kernel reads, unmasked, for positions past a split
    wr = ok & (slot != 0)
    tl.store(zk + slot[:, None] * stride_zks + grp * stride_zkg + rk[None, :], _round_to(acc_k, zk.dtype.element_ty),
             mask=wr[:, None] & (rk < RK)[None, :])
    tl.store(zv + slot[:, None] * stride_zvs + grp * stride_zvg + rv[None, :], _round_to(acc_v, zv.dtype.element_ty),
             mask=wr[:, None] & (rv < RV)[None, :])
    tl.store(pos_buf + slot, p.to(tl.int32), mask=wr & (grp == 0))


def write_latents(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor, zk: torch.Tensor,
                  zv: torch.Tensor, pos: torch.Tensor, k_basis: torch.Tensor, v_basis: torch.Tensor,
                  cos_sin: torch.Tensor, neox: bool, chunk: int = CHUNK) -> None:
    """One layer's write: ``k`` (post-RoPE) and ``v`` ``[n, Hkv, D]`` (last dim contiguous), ``positions`` and
    ``loc`` ``[n]`` (any integer dtype; ``loc`` distinct slots) -> ``zk[loc]`` ``[n, groups, r_k]``, ``zv[loc]``
    ``[n, groups, r_v]`` (the pool dtype) and ``pos[loc]`` (int32). ``k_basis``/``v_basis`` ``[groups, g * D, r]``
    fp32; ``cos_sin`` ``[max_pos, D]`` (cosines, then sines; fp32 for the torch path's arithmetic); ``chunk``:
    rotation pairs a dot (tests take smaller ones to cover the loop). No host sync."""
    n, hkv, d = k.shape
    groups, gd, rk = k_basis.shape
    rv = v_basis.shape[2]
    if n == 0:
        return
    half = d // 2
    ch = min(chunk, half)
    assert fits(d) and cos_sin.shape[1] == d, "a power-of-two head dim of at least 32, every dimension rotated"
    assert gd % d == 0 and hkv == groups * (gd // d) and v.shape == k.shape and v_basis.shape[:2] == k_basis.shape[:2]
    assert ch >= 16 and half % ch == 0 and ch & (ch - 1) == 0, f"chunk {ch}: a power of two >= 16 dividing {half}"
    assert k.stride(2) == 1 and v.stride(2) == 1 and zk.stride(2) == 1 and zv.stride(2) == 1
    assert k_basis.stride(2) == 1 and v_basis.stride(2) == 1 and cos_sin.stride(1) == 1
    positions, loc = positions.contiguous(), loc.contiguous()
    _write_kernel[(triton.cdiv(n, BLOCK_TOKENS), groups)](
        k, v, positions, loc, zk, zv, pos, k_basis, v_basis, cos_sin, n,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), zk.stride(0), zk.stride(1), zv.stride(0), zv.stride(1),
        k_basis.stride(0), k_basis.stride(1), v_basis.stride(0), v_basis.stride(1), cos_sin.stride(0),
        GS=gd // d, D=d, HALF=half, CH=ch, NEOX=neox, RK=rk, RKP=triton.next_power_of_2(rk), RV=rv,
        RVP=triton.next_power_of_2(rv), BT=BLOCK_TOKENS, num_warps=4)
