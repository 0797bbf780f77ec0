"""Quest page selection (Tang et al., 2024, arXiv:2406.10774), batched on the device, no host sync.

Per physical KV page (``slot // page_size``) and KV head the method keeps the channel-wise min and max
of the page's post-RoPE keys. For a decode query ``q`` the page score ``sum_c max(q_c * min_c, q_c *
max_c)`` bounds ``q . k`` from above for every key of the page; the top pages are read exactly. One
score per (request, KV head) page: the max of the bound over the query heads of the group (a page
counts when any head of the group may attend to it), since one KV list serves the whole group.

Three steps, each a fixed-shape batched op (CUDA-graph safe):

* :func:`update_page_summaries` where K is written (prefill; decode on CPU): a token at page offset 0
  resets its page, so a page reused after a free starts clean; SGLang's padding page 0 absorbs the
  resets of the other tokens (and the writes of CUDA-graph padding rows), and is never scored. A decode
  step on the GPU writes one token per request, in distinct pages: :func:`update_decode_summaries`
  folds each key into its page in place, one Triton program per token and KV head;
* :func:`score_pages`: a Triton kernel over ``(request x KV head, program)``, each program looping
  over its share of the row's page blocks (bound read from ``seq_lens``); the rest of the row is
  ``-inf``. Sink and recent pages score ``+inf`` (always selected);
* :func:`~sgl_sparse.kernels.pages.select_pages_triton` on the GPU (a bisection for the ``k``-th score, no
  sort), :func:`~sgl_sparse.kernels.pages.select_pages` (a static-``k`` top-k and a sort) on the CPU.

Scoring has a plain-torch path for CPU (:func:`score_pages_torch`); tests check the Triton kernel
against it and both against a reference written in the test.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels.pages import MMA_SCORE_DTYPES, page_counts

BLOCK_PAGES = 64  # pages per block a scoring program scores at once
# Scoring programs per (request, KV head), each looping over its share of page blocks: ~2,048 in all, 16-128
# a row (a fixed 16 gives one long request too few programs to reach memory bandwidth). Depends on the batch
# size only (fixed in a graph).
MIN_PROGRAMS_PER_ROW = 16
PROGRAMS_PER_ROW = 128  # at most
TARGET_PROGRAMS = 2048
NEG = float("-inf")
POS = float("inf")


def update_page_summaries(kmin: torch.Tensor, kmax: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                          page_size: int) -> None:
    """Fold the keys ``k`` (``[n, Hkv, D]``) written at slots ``loc`` (``[n]``) into their pages' min/max
    (``[num_pages, Hkv, D]``). Fixed shapes and no host sync (runs inside decode CUDA graphs)."""
    if loc.numel() == 0:
        return
    loc = loc.long()
    page = loc // page_size
    reset = torch.where(loc % page_size == 0, page, torch.zeros_like(page))
    kmin.index_fill_(0, reset, POS)
    kmax.index_fill_(0, reset, NEG)
    k = k.reshape(loc.numel(), kmin.shape[1], kmin.shape[2]).to(kmin.dtype)
    idx = page[:, None, None].expand_as(k)
    kmin.scatter_reduce_(0, idx, k, "amin", include_self=True)
    kmax.scatter_reduce_(0, idx, k, "amax", include_self=True)


@triton.jit
def _decode_summary_kernel(kmin, kmax, loc, k, stride_kt, stride_kh, stride_sp, stride_sh, PAGE: tl.constexpr,
                           D: tl.constexpr):
    """Program (written token, KV head): its page's min and max folded with the key in place; a token at
    page offset 0 starts the page afresh."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(loc + t).to(tl.int64)
    d = tl.arange(0, D)
    key = tl.load(k + t * stride_kt + h * stride_kh + d).to(kmin.dtype.element_ty)
    off = (slot // PAGE) * stride_sp + h * stride_sh + d
    fresh = slot % PAGE == 0
    tl.store(kmin + off, tl.where(fresh, key, tl.minimum(tl.load(kmin + off), key)))
    tl.store(kmax + off, tl.where(fresh, key, tl.maximum(tl.load(kmax + off), key)))


def update_decode_summaries(kmin: torch.Tensor, kmax: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                            page_size: int) -> None:
    """:func:`update_page_summaries` for a decode step's write, whose slots lie in distinct pages (one new token
    per request; CUDA-graph padding rows all write SGLang's padding page 0, never scored, so their race there
    is harmless): one Triton program per (token, KV head) updates its page in place. The general path (a reset,
    two index fills and two ``scatter_reduce``) is several kernels for a handful of tokens."""
    n = loc.numel()
    if n == 0:
        return
    d = kmin.shape[2]
    assert d & (d - 1) == 0 and kmin.stride(2) == 1 and kmax.stride() == kmin.stride()
    k = k.reshape(n, kmin.shape[1], d)
    assert k.stride(2) == 1
    _decode_summary_kernel[(n, kmin.shape[1])](kmin, kmax, loc, k, k.stride(0), k.stride(1), kmin.stride(0),
                                               kmin.stride(1), PAGE=page_size, D=d)


@triton.jit
def _score_row(seq_lens, req_pool_indices, scores, max_pages, HKV: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_P: tl.constexpr):
    """A scoring program's row (grid: request x KV head, program): request ``i``, KV head ``h``, program ``pid``,
    the row's pages and page blocks, its ``req_to_token`` row and its row of ``scores``."""
    rh = tl.program_id(0)
    i = rh // HKV
    npages = (tl.load(seq_lens + i) + PAGE - 1) // PAGE
    row = tl.load(req_pool_indices + i).to(tl.int64)
    return (i, rh % HKV, tl.program_id(1), npages, (npages + BLOCK_P - 1) // BLOCK_P, row,
            scores + rh.to(tl.int64) * max_pages)


@triton.jit
def _block_summaries(kmin, kmax, req_to_token, row, h, blk, npages, stride_r2t: tl.constexpr, HKV: tl.constexpr,
                     D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr):
    """Page block ``blk`` of a row: its page indices and KV head ``h``'s summaries ``[BLOCK_P, D]`` in their own
    dtype, read through each page's first slot (0 past the row's pages)."""
    offs_p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = offs_p < npages
    slot = tl.load(req_to_token + row * stride_r2t + offs_p * PAGE, mask=valid, other=0).to(tl.int64)
    base = ((slot // PAGE) * HKV + h)[:, None] * D + tl.arange(0, D)[None, :]
    return (offs_p, tl.load(kmin + base, mask=valid[:, None], other=0.0),
            tl.load(kmax + base, mask=valid[:, None], other=0.0))


@triton.jit
def _store_block(out_row, offs_p, best, npages, sink_pages, recent_pages, max_pages):
    """A block's scores: sink and recent pages ``+inf`` (always selected), pages past the row ``-inf``."""
    forced = (offs_p < sink_pages) | (offs_p >= npages - recent_pages)
    best = tl.where(forced, float("inf"), best)
    best = tl.where(offs_p < npages, best, float("-inf"))
    tl.store(out_row + offs_p, best, mask=offs_p < max_pages)


@triton.jit
def _fill_rest(out_row, nblk, pid, max_pages, BLOCK_P: tl.constexpr, NPROG: tl.constexpr):
    """``-inf`` over the program's blocks past the row's last page (a row scored at full width)."""
    for blk in range(nblk + pid, (max_pages + BLOCK_P - 1) // BLOCK_P, NPROG):
        offs_p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
        tl.store(out_row + offs_p, tl.full((BLOCK_P,), float("-inf"), tl.float32), mask=offs_p < max_pages)


@triton.jit
def _score_kernel(q, kmin, kmax, req_to_token, req_pool_indices, seq_lens, scores, max_pages, sink_pages,
                  recent_pages, stride_r2t: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
                  D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr, NPROG: tl.constexpr):
    """Grid (request x KV head, NPROG): program ``pid`` scores page blocks ``pid, pid + NPROG, ...`` up to
    the row's page count (a loop bound read from ``seq_lens``: the work follows the real lengths, also
    in a graph captured for the full context), then writes ``-inf`` over its blocks of the rest."""
    i, h, pid, npages, nblk, row, out_row = _score_row(seq_lens, req_pool_indices, scores, max_pages, HKV, PAGE,
                                                       BLOCK_P)
    offs_d = tl.arange(0, D)
    q_row = q + (i * HKV * GROUP + h * GROUP).to(tl.int64) * D
    for blk in range(pid, nblk, NPROG):
        offs_p, lo, hi = _block_summaries(kmin, kmax, req_to_token, row, h, blk, npages, stride_r2t, HKV, D, PAGE,
                                          BLOCK_P)
        lo, hi = lo.to(tl.float32), hi.to(tl.float32)
        best = tl.full((BLOCK_P,), float("-inf"), tl.float32)
        for g in tl.static_range(GROUP):
            qg = tl.load(q_row + g * D + offs_d).to(tl.float32)
            best = tl.maximum(best, tl.sum(tl.maximum(qg[None, :] * lo, qg[None, :] * hi), axis=1))
        _store_block(out_row, offs_p, best, npages, sink_pages, recent_pages, max_pages)
    _fill_rest(out_row, nblk, pid, max_pages, BLOCK_P, NPROG)


@triton.jit
def _score_kernel_mma(q, kmin, kmax, req_to_token, req_pool_indices, seq_lens, scores, max_pages, sink_pages,
                      recent_pages, stride_r2t: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
                      GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr,
                      NPROG: tl.constexpr, IEEE: tl.constexpr):
    """:func:`_score_kernel` as two dots on the tensor cores. Since ``min <= max``, ``max(q min, q max)`` is ``q
    max`` where ``q >= 0`` and ``q min`` elsewhere, so a page's bound is ``q+ . max + q- . min`` (``q+`` and ``q-``
    the query's positive and negative parts): the group's queries ``[GP, D]`` against the block's summaries
    ``[BLOCK_P, D]`` in their own dtype (exact products, fp32 sums; ``IEEE``: fp32 summaries without TF32), then the
    max over the group's rows. The per-element work of the CUDA-core kernel (two multiplies, a max and an add per
    query head) goes; the summaries' read is what is left."""
    i, h, pid, npages, nblk, row, out_row = _score_row(seq_lens, req_pool_indices, scores, max_pages, HKV, PAGE,
                                                       BLOCK_P)
    offs_d = tl.arange(0, D)
    gi = tl.arange(0, GP)
    qg = tl.load(q + (i * HKV * GROUP + h * GROUP + gi).to(tl.int64)[:, None] * D + offs_d[None, :],
                 mask=(gi < GROUP)[:, None], other=0.0)
    qpos = tl.maximum(qg, 0.0).to(kmin.dtype.element_ty)
    qneg = tl.minimum(qg, 0.0).to(kmin.dtype.element_ty)
    for blk in range(pid, nblk, NPROG):
        offs_p, lo, hi = _block_summaries(kmin, kmax, req_to_token, row, h, blk, npages, stride_r2t, HKV, D, PAGE,
                                          BLOCK_P)
        if IEEE:
            s = tl.dot(qpos, tl.trans(hi), input_precision="ieee") + tl.dot(qneg, tl.trans(lo), input_precision="ieee")
        else:
            s = tl.dot(qpos, tl.trans(hi)) + tl.dot(qneg, tl.trans(lo))
        best = tl.max(tl.where((gi < GROUP)[:, None], s, float("-inf")), 0)
        _store_block(out_row, offs_p, best, npages, sink_pages, recent_pages, max_pages)
    _fill_rest(out_row, nblk, pid, max_pages, BLOCK_P, NPROG)


def score_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scores: torch.Tensor, page_size: int,
                sink_pages: int, recent_pages: int, mma: bool | None = None) -> torch.Tensor:
    """Page scores ``[bs * Hkv, max_pages]`` (fp32, written into ``scores``) of a decode batch: ``q``
    ``[bs, Hq, D]``, ``seq_lens`` ``[bs]`` including this step's token. ``mma``: the tensor-core kernel
    (:func:`_score_kernel_mma`; same bounds, summed in another order); ``None`` (the default) takes it for float
    summaries: faster than the CUDA-core kernel at long rows, same selection (benchmarks/selection_overhead.py)."""
    bs, hq, d = q.shape
    hkv = kmin.shape[1]
    max_pages = scores.shape[1]
    if bs == 0:
        return scores[:0]
    want = triton.next_power_of_2(max(1, -(-TARGET_PROGRAMS // (bs * hkv))))
    nprog = min(max(MIN_PROGRAMS_PER_ROW, min(PROGRAMS_PER_ROW, want)), triton.cdiv(max_pages, BLOCK_PAGES))
    if mma is None:
        mma = kmin.dtype in MMA_SCORE_DTYPES
    if mma:
        # The queries go to the summaries' dtype (exact for bf16 queries against bf16 or fp32 summaries), so only
        # float summaries. The dot's rows: the group padded to 16, the tensor cores' tile (at 4 rows the compiled
        # loop has more instructions: 3.5 a summary element against 2.6). Under the interpreter, which has no
        # 16-bit float dots, fp32.
        assert kmin.dtype in MMA_SCORE_DTYPES, "float page summaries"
        sums = kmin if q.is_cuda else kmin.float()
        _score_kernel_mma[(bs * hkv, nprog)](
            q.contiguous(), sums, kmax if q.is_cuda else kmax.float(), req_to_token, req_pool_indices, seq_lens,
            scores, max_pages, sink_pages, recent_pages, req_to_token.stride(0), HKV=hkv, GROUP=hq // hkv,
            GP=max(16, triton.next_power_of_2(hq // hkv)), D=d, PAGE=page_size, BLOCK_P=BLOCK_PAGES, NPROG=nprog,
            IEEE=sums.dtype == torch.float32)
        return scores[: bs * hkv]
    _score_kernel[(bs * hkv, nprog)](q.contiguous(), kmin, kmax, req_to_token, req_pool_indices, seq_lens, scores,
                                     max_pages, sink_pages, recent_pages, req_to_token.stride(0), HKV=hkv,
                                     GROUP=hq // hkv, D=d, PAGE=page_size, BLOCK_P=BLOCK_PAGES, NPROG=nprog)
    return scores[: bs * hkv]


def score_pages_torch(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, req_to_token: torch.Tensor,
                      req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scores: torch.Tensor, page_size: int,
                      sink_pages: int, recent_pages: int) -> torch.Tensor:
    """:func:`score_pages` in plain torch (the CPU server's path): same values, O(max_pages) per row."""
    bs, hq, d = q.shape
    hkv = kmin.shape[1]
    max_pages = scores.shape[1]
    p = torch.arange(max_pages, device=q.device)
    npages = page_counts(seq_lens.long(), page_size)[:, None]  # [bs, 1]
    valid = p[None, :] < npages
    cols = torch.clamp(p * page_size, max=req_to_token.shape[1] - 1)
    slots = req_to_token[req_pool_indices.long()][:, cols].long()  # [bs, P]
    phys = torch.where(valid, slots // page_size, torch.zeros_like(slots))
    lo, hi = kmin[phys].float(), kmax[phys].float()  # [bs, P, Hkv, D]
    qg = q.float().view(bs, 1, hkv, hq // hkv, d)  # [bs, 1, Hkv, G, D]
    s = torch.maximum(qg * lo[:, :, :, None], qg * hi[:, :, :, None]).sum(-1).amax(-1)  # [bs, P, Hkv]
    forced = (p[None, :] < sink_pages) | (p[None, :] >= npages - recent_pages)
    s = torch.where(forced[:, :, None], POS, s)
    s = torch.where(valid[:, :, None], s, NEG)
    scores[: bs * hkv] = s.permute(0, 2, 1).reshape(bs * hkv, max_pages)
    return scores[: bs * hkv]


