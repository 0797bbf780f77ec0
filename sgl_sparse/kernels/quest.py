"""Quest page selection (Tang et al., 2024, arXiv:2406.10774), batched on the device, no host sync.

Per physical KV page (``slot // page_size``) and KV head the method keeps the channel-wise min and max
of the page's post-RoPE keys. For a decode query ``q`` the page score ``sum_c max(q_c * min_c, q_c *
max_c)`` bounds ``q . k`` from above for every key of the page; the top pages are read exactly. One
score per (request, KV head) page: the max of the bound over the query heads of the group (a page
counts when any head of the group may attend to it), since one KV list serves the whole group.

Three steps, each a fixed-shape batched op (CUDA-graph safe):

* :func:`update_page_summaries` where K is written (prefill and decode): a token at page offset 0
  resets its page, so a page reused after a free starts clean; SGLang's padding page 0 absorbs the
  resets of the other tokens (and the writes of CUDA-graph padding rows), and is never scored;
* :func:`score_pages`: a Triton kernel over ``(request x KV head, page block)``; blocks past a row's
  page count write ``-inf`` only. Sink and recent pages score ``+inf`` (always selected);
* :func:`~sgl_sparse.kernels.pages.select_pages`: a static-``k`` top-k and a sort.

Scoring has a plain-torch path for CPU (:func:`score_pages_torch`); tests check the Triton kernel
against it and both against a reference written in the test.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels.pages import page_counts

BLOCK_PAGES = 64  # pages per scoring program
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
def _score_kernel(q, kmin, kmax, req_to_token, req_pool_indices, seq_lens, scores, max_pages, sink_pages,
                  recent_pages, stride_r2t: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
                  D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr):
    rh = tl.program_id(0)
    blk = tl.program_id(1)
    i = rh // HKV
    h = rh % HKV
    offs_p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.load(seq_lens + i)
    npages = (n + PAGE - 1) // PAGE
    out = scores + rh.to(tl.int64) * max_pages + offs_p
    in_range = offs_p < max_pages
    valid = offs_p < npages  # a block past the row's pages loads nothing and writes -inf
    row = tl.load(req_pool_indices + i).to(tl.int64)
    slot = tl.load(req_to_token + row * stride_r2t + offs_p * PAGE, mask=valid, other=0).to(tl.int64)
    phys = slot // PAGE
    offs_d = tl.arange(0, D)
    base = (phys * HKV + h)[:, None] * D + offs_d[None, :]
    lo = tl.load(kmin + base, mask=valid[:, None], other=0.0).to(tl.float32)
    hi = tl.load(kmax + base, mask=valid[:, None], other=0.0).to(tl.float32)
    best = tl.full((BLOCK_P,), float("-inf"), tl.float32)
    for g in tl.static_range(GROUP):
        qg = tl.load(q + (i * HKV * GROUP + h * GROUP + g).to(tl.int64) * D + offs_d).to(tl.float32)
        s = tl.sum(tl.maximum(qg[None, :] * lo, qg[None, :] * hi), axis=1)
        best = tl.maximum(best, s)
    forced = (offs_p < sink_pages) | (offs_p >= npages - recent_pages)
    best = tl.where(forced, float("inf"), best)
    best = tl.where(valid, best, float("-inf"))
    tl.store(out, best, mask=in_range)


def score_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scores: torch.Tensor, page_size: int,
                sink_pages: int, recent_pages: int) -> torch.Tensor:
    """Page scores ``[bs * Hkv, max_pages]`` (fp32, written into ``scores``) of a decode batch: ``q``
    ``[bs, Hq, D]``, ``seq_lens`` ``[bs]`` including this step's token."""
    bs, hq, d = q.shape
    hkv = kmin.shape[1]
    max_pages = scores.shape[1]
    if bs == 0:
        return scores[:0]
    grid = (bs * hkv, triton.cdiv(max_pages, BLOCK_PAGES))
    _score_kernel[grid](q.contiguous(), kmin, kmax, req_to_token, req_pool_indices, seq_lens, scores, max_pages,
                        sink_pages, recent_pages, req_to_token.stride(0), HKV=hkv, GROUP=hq // hkv, D=d,
                        PAGE=page_size, BLOCK_P=BLOCK_PAGES)
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


