"""OmniKV's token scores (Triton and plain torch, no host sync).

For each request of a decode batch, the score of each of its tokens is the largest ``q . k`` over all
query heads (OmniKV's "last" selector: the current query only, raw logits, max over heads), read
through the request's ``req_to_token`` row. Sink and recent positions score ``+inf`` (always kept).
The softmax scale is left out: it does not change the ranking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels.pages import MMA_SCORE_DTYPES

INF = float("inf")
# Programs per request, so that a batch of a few 130K-token requests still fills the GPU: each program
# loops over every PROGRAMS-th block of its row's real tokens (the loop bound comes from seq_lens, so a
# graph captured at full width does no work past a row's length). A fixed 64 a row reads K far below
# bandwidth for one or a few long requests (programs of many dependent block loads hide too little
# latency); ~2,048 programs in all, at
# least 64 a row, leave each a few blocks at 130K. The grid depends on the batch size only, which a
# CUDA graph fixes anyway.
MIN_PROGRAMS_PER_ROW = 64
MAX_PROGRAMS_PER_ROW = 1024
TARGET_PROGRAMS = 2048
BLOCK_TOKENS = 64


def programs_per_row(bs: int) -> int:
    """Scoring programs a request gets in a batch of ``bs``: a power of two from 64 to 1,024."""
    want = triton.next_power_of_2(max(1, -(-TARGET_PROGRAMS // max(bs, 1))))
    return max(MIN_PROGRAMS_PER_ROW, min(MAX_PROGRAMS_PER_ROW, want))


@triton.jit
def _block_slots(req_to_token, row, stride_r2t, b, n, BLOCK: tl.constexpr):
    """Block ``b`` of a row: its positions, which are the row's (``< n``), and their slots."""
    pos = b * BLOCK + tl.arange(0, BLOCK)
    m = pos < n
    return pos, m, tl.load(req_to_token + row * stride_r2t + pos, mask=m, other=0).to(tl.int64)


@triton.jit
def _store_scores(out_row, pos, best, n, sink, recent):
    """A block's scores, sink and recent positions ``+inf`` (always kept); nothing past the row's length."""
    forced = (pos < sink) | (pos >= n - recent)
    tl.store(out_row + pos, tl.where(forced, float("inf"), best), mask=pos < n)


@triton.jit
def _score_tokens_kernel(q, k_cache, req_to_token, req_pool_indices, seq_lens, out, stride_qb, stride_qh,
                         stride_ks, stride_kh, stride_r2t, stride_out, sink, recent, HKV: tl.constexpr,
                         G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    i = tl.program_id(0)
    p = tl.program_id(1)
    n = tl.load(seq_lens + i)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    d = tl.arange(0, D)
    for b in range(p, tl.cdiv(n, BLOCK), PROGRAMS):
        pos, m, slot = _block_slots(req_to_token, row, stride_r2t, b, n, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        for h in tl.static_range(HKV):
            k = tl.load(k_cache + slot[:, None] * stride_ks + h * stride_kh + d[None, :], mask=m[:, None],
                        other=0.0).to(tl.float32)
            for g in tl.static_range(G):
                qv = tl.load(q + i * stride_qb + (h * G + g) * stride_qh + d).to(tl.float32)
                best = tl.maximum(best, tl.sum(k * qv[None, :], 1))
        _store_scores(out + i * stride_out, pos, best, n, sink, recent)


@triton.jit
def _score_tokens_kernel_mma(q, k_cache, req_to_token, req_pool_indices, seq_lens, out, stride_qb, stride_qh,
                             stride_ks, stride_kh, stride_r2t, stride_out, sink, recent, HKV: tl.constexpr,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                             PROGRAMS: tl.constexpr, IEEE: tl.constexpr):
    """:func:`_score_tokens_kernel` with each KV head's logits as one dot on the tensor cores: the group's queries
    ``[GP, D]`` (in the cache's dtype: exact products, fp32 sums; ``IEEE``: an fp32 cache without TF32) against the
    block's keys ``[BLOCK, D]``, then the max over the group's rows. The queries are loaded once a program."""
    i = tl.program_id(0)
    p = tl.program_id(1)
    n = tl.load(seq_lens + i)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    d = tl.arange(0, D)
    gi = tl.arange(0, GP)
    qs = ()
    for h in tl.static_range(HKV):
        qh = tl.load(q + i * stride_qb + (h * G + gi)[:, None] * stride_qh + d[None, :], mask=(gi < G)[:, None],
                     other=0.0)
        qs = qs + (qh.to(k_cache.dtype.element_ty),)
    for b in range(p, tl.cdiv(n, BLOCK), PROGRAMS):
        pos, m, slot = _block_slots(req_to_token, row, stride_r2t, b, n, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        for h in tl.static_range(HKV):
            k = tl.load(k_cache + slot[:, None] * stride_ks + h * stride_kh + d[None, :], mask=m[:, None], other=0.0)
            if IEEE:
                s = tl.dot(qs[h], tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(qs[h], tl.trans(k))
            best = tl.maximum(best, tl.max(tl.where((gi < G)[:, None], s, float("-inf")), 0))
        _store_scores(out + i * stride_out, pos, best, n, sink, recent)


def score_tokens(q: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, sink: int,
                 recent: int, mma: bool | None = None) -> None:
    """``out[i, t]`` (``[bs, W]`` float32) for ``t < seq_lens[i]``; entries past a row's length are not
    written. ``q`` ``[bs, Hq, D]``, ``k_cache`` ``[slots, Hkv, D]``. ``mma``: the tensor-core kernel
    (:func:`_score_tokens_kernel_mma`, the same logits summed in another order); ``None`` (the default) takes it
    for a float K cache: faster than the CUDA-core kernel at long rows, same selection
    (benchmarks/selection_overhead.py)."""
    bs, hq, d = q.shape
    hkv = k_cache.shape[1]
    if bs == 0:
        return
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    assert k_cache.stride(2) == 1 and q.stride(2) == 1
    programs = programs_per_row(bs)
    if mma is None:
        mma = k_cache.dtype in MMA_SCORE_DTYPES
    if mma:
        # The queries go to the cache's dtype, so only a float cache. The dot's rows: the group padded to 16, the
        # tensor cores' tile (at 4 rows the compiled loop has more instructions: 2.5 a K element against 2.0).
        # Under the interpreter, which has no 16-bit float dots, fp32.
        assert k_cache.dtype in MMA_SCORE_DTYPES, "a float K cache"
        kc = k_cache if q.is_cuda else k_cache.float()
        _score_tokens_kernel_mma[(bs, programs)](
            q, kc, req_to_token, req_pool_indices, seq_lens, out, q.stride(0), q.stride(1), kc.stride(0),
            kc.stride(1), req_to_token.stride(0), out.stride(0), sink, recent, HKV=hkv, G=hq // hkv,
            GP=max(16, triton.next_power_of_2(hq // hkv)), D=d, BLOCK=BLOCK_TOKENS, PROGRAMS=programs,
            IEEE=kc.dtype == torch.float32)
        return
    _score_tokens_kernel[(bs, programs)](
        q, k_cache, req_to_token, req_pool_indices, seq_lens, out, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), req_to_token.stride(0), out.stride(0), sink, recent, HKV=hkv, G=hq // hkv, D=d,
        BLOCK=BLOCK_TOKENS, PROGRAMS=programs)


def score_tokens_torch(q: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, sink: int,
                       recent: int) -> None:
    """:func:`score_tokens` in torch (the CPU server's path); also writes ``-inf`` past each row's length."""
    bs, hq, d = q.shape
    if bs == 0:
        return
    hkv = k_cache.shape[1]
    width = out.shape[1]
    slots = req_to_token[req_pool_indices.long(), :width].long()  # [bs, W]
    k = k_cache[slots].to(torch.float32)  # [bs, W, Hkv, D]
    qg = q.to(torch.float32).view(bs, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,bwhd->bwhg", qg, k).amax(dim=(2, 3))
    pos = torch.arange(width, device=q.device)[None, :]
    n = seq_lens.long()[:, None]
    s = torch.where((pos < sink) | (pos >= n - recent), torch.full_like(s, INF), s)
    out.copy_(torch.where(pos < n, s, torch.full_like(s, -INF)))
