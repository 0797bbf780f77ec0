"""KIVI's decode-step write as one Triton kernel: each row's new token into its residual, and the page that
token fills quantized into the pool.

Why: the torch form (``KIVIStore.write(decode=True)``) quantizes every row's whole residual at every step, so
that no host sync decides which rows filled a page, in a few dozen small kernels a layer, a cost that grows
with the batch. Here one program per (row, KV head) writes its token and returns unless the token
is its page's last (``loc % GS == GS - 1``, read on the device: CUDA-graph safe); the few that fill a page
quantize ``GS`` x ``D`` values.

The arithmetic is :func:`sgl_sparse.kernels.quant.asym_quantize`'s, in fp32, with IEEE division and
round-half-to-even, so the codes, scales and zero points equal the torch path's (tested under the interpreter):
keys per channel over the page's ``GS`` tokens, values per token over groups of ``GS`` channels, codes packed
chunk-major (:func:`quant.pack_chunks`: byte ``j`` holds channel ``c * W + j`` in bits ``[c * bits, (c + 1) *
bits)``), scales and zero points stored in fp16. The residual holds the model dtype, so the new token is
rounded to it before it is quantized with the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Adding 1.5 * 2^23 to an fp32 in [0, 2^22) rounds it to an integer, half to even (torch.round's rule).
_RNE = tl.constexpr(12582912.0)


@triton.jit
def _round_even(x):
    return (x + _RNE) - _RNE


@triton.jit
def _codes(x, lo, hi, LEVELS: tl.constexpr):
    """``asym_quantize``'s codes of ``x`` against its group's ``lo``/``hi`` (broadcast), and the scale."""
    scale = tl.math.div_rn(hi - lo, tl.full(hi.shape, LEVELS, tl.float32))
    safe = tl.where(scale > 0, scale, 1.0)
    c = _round_even(tl.math.div_rn(x - lo, safe))
    return tl.minimum(tl.maximum(c, 0.0), LEVELS).to(tl.int32), scale


@triton.jit
def _pack(codes, GS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """``[GS, D]`` int32 codes -> ``[GS, W]`` bytes, chunk-major (``quant.pack_chunks``)."""
    P: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // P
    c = tl.reshape(codes, (GS, P, W))
    shifts = (tl.arange(0, P) * BITS)[None, :, None]
    return tl.sum(c << shifts, axis=1).to(tl.uint8)


@triton.jit
def _decode_write_kernel(k, v, loc, rows, res_k, res_v, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero,
                         stride_kb, stride_kh, stride_rr, stride_rt, stride_rh, stride_cs, stride_ch,
                         stride_ksp, stride_ksh, stride_vss, stride_vsh,
                         GS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    at = tl.load(loc + b).to(tl.int64)
    row = tl.load(rows + b).to(tl.int64)
    off = at % GS
    kn = tl.load(k + b * stride_kb + h * stride_kh + d).to(res_k.dtype.element_ty)
    vn = tl.load(v + b * stride_kb + h * stride_kh + d).to(res_v.dtype.element_ty)
    rk = res_k + row * stride_rr + h * stride_rh
    rv = res_v + row * stride_rr + h * stride_rh
    tl.store(rk + off * stride_rt + d, kn)
    tl.store(rv + off * stride_rt + d, vn)
    if off == GS - 1:
        # The page: the residual's first GS - 1 tokens and the new one, from registers (not re-read: the store
        # above is other threads' and would need a barrier).
        t = tl.arange(0, GS)
        last = (t == GS - 1)[:, None]
        kt = tl.load(rk + t[:, None] * stride_rt + d[None, :], mask=~last, other=0.0).to(tl.float32)
        vt = tl.load(rv + t[:, None] * stride_rt + d[None, :], mask=~last, other=0.0).to(tl.float32)
        kt = tl.where(last, kn.to(tl.float32)[None, :], kt)
        vt = tl.where(last, vn.to(tl.float32)[None, :], vt)
        LEVELS: tl.constexpr = (1 << BITS) - 1
        page = at // GS
        slot = page * GS + t
        # Keys: per channel over the page's tokens.
        klo = tl.min(kt, 0)
        kc, ks = _codes(kt, klo[None, :], tl.max(kt, 0)[None, :], LEVELS)
        W: tl.constexpr = D * BITS // 8
        w = tl.arange(0, W)
        tl.store(k_codes + slot[:, None] * stride_cs + h * stride_ch + w[None, :], _pack(kc, GS, D, BITS))
        ksp = k_scale + page * stride_ksp + h * stride_ksh + d
        tl.store(ksp, tl.reshape(ks, (D,)).to(tl.float16))
        tl.store(k_zero + page * stride_ksp + h * stride_ksh + d, klo.to(tl.float16))
        # Values: per token over groups of GS channels.
        NG: tl.constexpr = D // GS
        vg = tl.reshape(vt, (GS, NG, GS))
        vlo = tl.min(vg, 2)
        vc, vs = _codes(vg, vlo[:, :, None], tl.max(vg, 2)[:, :, None], LEVELS)
        tl.store(v_codes + slot[:, None] * stride_cs + h * stride_ch + w[None, :],
                 _pack(tl.reshape(vc, (GS, D)), GS, D, BITS))
        g = tl.arange(0, NG)
        vsp = slot[:, None] * stride_vss + h * stride_vsh + g[None, :]
        tl.store(v_scale + vsp, tl.reshape(vs, (GS, NG)).to(tl.float16))
        tl.store(v_zero + vsp, vlo.to(tl.float16))


def decode_write(buffers: tuple[torch.Tensor, ...], loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rows: torch.Tensor, bits: int, group: int) -> None:
    """One decode step's write: ``k``/``v`` ``[bs, Hkv, D]``, ``loc`` ``[bs]`` their slots, ``rows`` ``[bs]`` their
    ``req_pool_idx`` (distinct: one token a row). ``buffers``: ``KIVIStore._buffers(layer)``. No host sync."""
    k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, res_k, res_v = buffers
    bs, hkv, d = k.shape
    if bs == 0:
        return
    assert k.stride() == v.stride() and k.stride(2) == 1 and res_k.stride() == res_v.stride()
    assert k_codes.stride() == v_codes.stride() and k_scale.stride() == k_zero.stride()
    assert v_scale.stride() == v_zero.stride() and d % group == 0 and bits in (2, 4)
    _decode_write_kernel[(bs, hkv)](
        k, v, loc.contiguous(), rows.contiguous(), res_k, res_v, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero,
        k.stride(0), k.stride(1), res_k.stride(0), res_k.stride(1), res_k.stride(2), k_codes.stride(0),
        k_codes.stride(1), k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1),
        GS=group, D=d, BITS=bits, num_warps=4)
