"""SnapKV-style observation-window scores without materializing the attention matrix (Triton).

For one layer, ``w`` window queries ``q [w, H, D]`` and ``n`` keys ``k [n, Hkv, D]`` (GQA: query head
``h * G + j`` reads KV head ``h``, ``G = H / Hkv``), the score of key ``i`` for KV head ``h`` is

    per_head[h, i] = sum over (window query t, group member j) of softmax_i(scale * q[t, hG+j] . k[i, h])

with the softmax causal by logical position (a query never sees a later key). The plain-torch version
materializes ``[Hkv, G, w, n]`` float32 logits: 0.5 GB per layer at 130K keys and 32 query heads.
Here two passes over the keys stream them in blocks instead:

1. ``_row_stats_kernel``, grid (Hkv, key splits): per query row, the running max and sum of
   ``exp(logit - max)`` over one split of the keys; the splits are merged in torch (``[Hkv, S, R]``).
2. ``_prob_sum_kernel``, grid (Hkv, key blocks): ``exp(logit - max) / sum`` for every row, summed over
   the rows, written to ``per_head[h, block]``.

Rows are (window query, group member) pairs, padded to a power of two and masked. Keys are read
through row indices ``k_rows`` (key ``i`` is ``k[k_rows[i]]``): on a server ``k`` is the KV pool's
whole key buffer of the layer and ``k_rows`` the request's retained slots, so the retained keys are
never gathered into a copy (266 MB per layer at 130K keys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per block
SPLIT_N = 4096  # keys per program of the first pass


@triton.jit
def _load_q(q, q_pos, h, stride_qw, stride_qh, w, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
            D_P: tl.constexpr):
    """The rows' queries ``[R, D_P]``, row ids, and each row's logical position (-1 for padded rows: they
    see no key)."""
    rows = tl.arange(0, R)
    t = rows // G
    j = rows % G
    d = tl.arange(0, D_P)
    ptr = q + t[:, None] * stride_qw + (h * G + j)[:, None] * stride_qh + d[None, :]
    qb = tl.load(ptr, mask=(t < w)[:, None] & (d < D)[None, :], other=0.0)
    return qb, rows, tl.load(q_pos + t, mask=t < w, other=-1)


@triton.jit
def _logits(qb, k, k_rows, k_pos, q_pos_r, n, start, h, stride_kn, stride_kh, scale, D: tl.constexpr,
            D_P: tl.constexpr, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    d = tl.arange(0, D_P)
    rk = tl.load(k_rows + offs, mask=offs < n, other=0)
    kb = tl.load(k + rk[:, None] * stride_kn + h * stride_kh + d[None, :],
                 mask=(offs < n)[:, None] & (d < D)[None, :], other=0.0)
    kp = tl.load(k_pos + offs, mask=offs < n, other=0)
    s = tl.dot(qb, tl.trans(kb)).to(tl.float32) * scale  # [R, BLOCK]
    ok = (offs < n)[None, :] & (kp[None, :] <= q_pos_r[:, None])
    return tl.where(ok, s, float("-inf")), offs


@triton.jit
def _row_stats_kernel(q, k, k_rows, q_pos, k_pos, m_out, l_out, n, w, stride_qw, stride_qh, stride_kn, stride_kh,
                      scale, num_splits, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(0)
    sp = tl.program_id(1)
    qb, rows, q_pos_r = _load_q(q, q_pos, h, stride_qw, stride_qh, w, G, R, D, D_P)
    m = tl.full((R,), float("-inf"), dtype=tl.float32)
    acc = tl.zeros((R,), dtype=tl.float32)
    for start in range(sp * SPLIT, tl.minimum(sp * SPLIT + SPLIT, n), BLOCK):
        s, _ = _logits(qb, k, k_rows, k_pos, q_pos_r, n, start, h, stride_kn, stride_kh, scale, D, D_P, BLOCK)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m = m_new
    base = (h * num_splits + sp) * R
    tl.store(m_out + base + rows, m)
    tl.store(l_out + base + rows, acc)


@triton.jit
def _prob_sum_kernel(q, k, k_rows, q_pos, k_pos, m_in, l_in, out, n, w, stride_qw, stride_qh, stride_kn, stride_kh,
                     scale, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(0)
    blk = tl.program_id(1)
    qb, rows, q_pos_r = _load_q(q, q_pos, h, stride_qw, stride_qh, w, G, R, D, D_P)
    m = tl.load(m_in + h * R + rows)
    inv_l = tl.load(l_in + h * R + rows)  # 1 / sum (0 for rows that see no key)
    s, offs = _logits(qb, k, k_rows, k_pos, q_pos_r, n, blk * BLOCK, h, stride_kn, stride_kh, scale, D, D_P, BLOCK)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(s - m_safe[:, None]) * inv_l[:, None]
    tl.store(out + h * n + offs, tl.sum(p, axis=0), mask=offs < n)


def window_scores_per_head(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                           scale: float, k_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[Hkv, n]`` float32: each key's softmax probability summed over window queries and GQA group.
    Key ``i`` is ``k[k_rows[i]]`` (``k[i]`` without ``k_rows``); ``n = len(k_pos)``."""
    w, n_heads, d = q.shape
    n = int(k_pos.numel())
    n_kv = k.shape[1]
    assert n_heads % n_kv == 0 and k.shape[2] == d and q.stride(2) == 1 and k.stride(2) == 1
    if k_rows is None:
        assert k.shape[0] == n
        k_rows = torch.arange(n, device=k.device)
    assert k_rows.numel() == n, (k_rows.shape, n)
    if k.dtype != q.dtype:  # converting a whole pool buffer would cost more than the gather
        k, k_rows = k[k_rows].to(q.dtype), torch.arange(n, device=k.device)
    group = n_heads // n_kv
    rows = max(16, triton.next_power_of_2(w * group))  # tl.dot needs >= 16
    d_p = max(16, triton.next_power_of_2(d))
    out = torch.zeros((n_kv, n), dtype=torch.float32, device=k.device)
    if n == 0:
        return out
    q_pos = q_pos.to(device=k.device, dtype=torch.int64).contiguous()
    k_pos = k_pos.to(device=k.device, dtype=torch.int64).contiguous()
    k_rows = k_rows.to(device=k.device, dtype=torch.int64).contiguous()
    splits = triton.cdiv(n, SPLIT_N)
    m = torch.empty((n_kv, splits, rows), dtype=torch.float32, device=k.device)
    l_part = torch.empty_like(m)
    _row_stats_kernel[(n_kv, splits)](q, k, k_rows, q_pos, k_pos, m, l_part, n, w, q.stride(0), q.stride(1),
                                      k.stride(0), k.stride(1), scale, splits, G=group, R=rows, D=d, D_P=d_p,
                                      SPLIT=SPLIT_N, BLOCK=BLOCK_N)
    m_all = m.amax(dim=1)  # [Hkv, R]
    m_safe = torch.where(torch.isinf(m_all), torch.zeros_like(m_all), m_all)
    l_all = (l_part * torch.exp(m - m_safe[:, None, :]).nan_to_num(0.0)).sum(dim=1)
    inv_l = torch.where(l_all > 0, 1.0 / l_all.clamp_min(1e-30), torch.zeros_like(l_all)).contiguous()
    _prob_sum_kernel[(n_kv, triton.cdiv(n, BLOCK_N))](q, k, k_rows, q_pos, k_pos, m_all.contiguous(), inv_l, out,
                                                      n, w, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                                      scale, G=group, R=rows, D=d, D_P=d_p, BLOCK=BLOCK_N)
    return out
