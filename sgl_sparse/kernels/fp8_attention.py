"""Decode attention over an FP8 (E4M3) KV pool with per-(token, head) scales, dequantized in registers.

Not served yet (the quantization issue's method-owned pool will call it). Layout: codes ``[slots, Hkv,
D]`` uint8 (the bits of ``float8_e4m3fn``: :func:`sgl_sparse.kernels.quant.fp8_quantize` viewed as
uint8), scales ``[slots, Hkv]`` fp32, one per token and head, for K and for V. A row's tokens are read
through ``req_to_token`` as in SGLang's own decode kernels.

Grid: request x KV head x ``splits`` (split-KV, so a batch of a few long requests fills the GPU); each
program walks its share of the row's ``seq_lens`` tokens (a graph captured at full width does no work
past a row's real length), keeps the online-softmax state of the group's query heads, and the splits
are merged in torch. The key scale multiplies the logits (``q . (s_k c) = s_k (q . c)``: one multiply
per token and query head, not one per element); the value scale multiplies the decoded value rows.

E4M3 is decoded from its bits by arithmetic (sign, 4-bit exponent of bias 7, 3-bit mantissa,
subnormals at exponent 0): the same code runs under ``TRITON_INTERPRET=1``, where fp8 types are not
available. :func:`decode_attention_torch` is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels.splits import merge_splits, online_step

SPLITS = 16


def decode_attention_torch(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                           v_scale: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense decode over the dequantized rows, one request at a time (the reference; ``q`` ``[bs, Hq, D]``)."""
    bs, hq, d = q.shape
    hkv = k_codes.shape[1]
    out = torch.zeros_like(q)
    for i in range(bs):
        n = int(seq_lens[i])
        if n == 0:
            continue
        slots = req_to_token[int(req_pool_indices[i]), :n].long()
        k = k_codes[slots].view(torch.float8_e4m3fn).to(torch.float32) * k_scale[slots][..., None]
        v = v_codes[slots].view(torch.float8_e4m3fn).to(torch.float32) * v_scale[slots][..., None]
        qg = q[i].to(torch.float32).view(hkv, hq // hkv, d)
        w = torch.softmax(torch.einsum("hgd,nhd->hgn", qg, k) * scale, dim=-1)
        out[i] = torch.einsum("hgn,nhd->hgd", w, v).reshape(hq, d).to(q.dtype)
    return out


@triton.jit
def _e4m3(b):
    """uint8 bits of E4M3 -> fp32."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))  # 2^-9; (1+m/8)2^(e-7)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _decode_kernel(q, k_codes, k_scale, v_codes, v_scale, req_to_token, req_pool_indices, seq_lens, ws_m, ws_l,
                   ws_acc, stride_qb, stride_qh, stride_cs, stride_ch, stride_ss, stride_r2t, scale,
                   HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                   NSPLIT: tl.constexpr):
    rh = tl.program_id(0)
    pid = tl.program_id(1)
    i = rh // HKV
    h = rh % HKV
    n = tl.load(seq_lens + i)
    per = tl.cdiv(tl.cdiv(n, NSPLIT), BLOCK) * BLOCK
    lo = pid * per
    hi = tl.minimum(lo + per, n)
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    gi = tl.arange(0, GP)
    gm = gi < G
    d = tl.arange(0, D)
    qv = tl.load(q + i * stride_qb + (h * G + gi)[:, None] * stride_qh + d[None, :], mask=gm[:, None],
                 other=0.0).to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        ok = pos < hi
        slot = tl.load(row_ptr + pos, mask=ok, other=0).to(tl.int64)
        kc = tl.load(k_codes + slot[:, None] * stride_cs + h * stride_ch + d[None, :], mask=ok[:, None], other=0)
        vc = tl.load(v_codes + slot[:, None] * stride_cs + h * stride_ch + d[None, :], mask=ok[:, None], other=0)
        ks = tl.load(k_scale + slot * stride_ss + h, mask=ok, other=0.0)
        vs = tl.load(v_scale + slot * stride_ss + h, mask=ok, other=0.0)
        s = tl.dot(qv, tl.trans(_e4m3(kc))) * (ks * scale)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m, den, acc = online_step(m, den, acc, s, _e4m3(vc) * vs[:, None])
    w = (rh.to(tl.int64) * NSPLIT + pid) * G
    tl.store(ws_m + w + gi, m, mask=gm)
    tl.store(ws_l + w + gi, den, mask=gm)
    tl.store(ws_acc + (w + gi)[:, None] * D + d[None, :], acc, mask=gm[:, None])


def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                     v_scale: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, splits: int = SPLITS) -> torch.Tensor:
    """:func:`decode_attention_torch` as one Triton kernel over the batch, then the splits' merge.
    Codes uint8; no host sync (fixed shapes, loop bounds from ``seq_lens`` on the device)."""
    bs, hq, d = q.shape
    hkv = k_codes.shape[1]
    if bs == 0:
        return torch.empty_like(q)
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    assert k_codes.dtype == torch.uint8 and v_codes.stride() == k_codes.stride() and k_codes.stride(2) == 1
    assert v_scale.stride() == k_scale.stride() and k_scale.stride(1) == 1 and q.stride(2) == 1
    g = hq // hkv
    ws_m = torch.empty(bs * hkv, splits, g, dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty(bs * hkv, splits, g, d, dtype=torch.float32, device=q.device)
    _decode_kernel[(bs * hkv, splits)](
        q, k_codes, k_scale, v_codes, v_scale, req_to_token, req_pool_indices, seq_lens, ws_m, ws_l, ws_acc,
        q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1), k_scale.stride(0), req_to_token.stride(0),
        scale, HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK=16, NSPLIT=splits)
    return merge_splits(ws_m, ws_l, ws_acc).view(bs, hq, d).to(q.dtype)
