"""Page selections as attention inputs: lengths, top-k, slot lists (Triton and plain torch, no host sync).

A selection is, per (request, KV head) row ``i * Hkv + h``, the ascending logical pages to read
(``[rows, width]`` int64), unused entries last at a value no row's page count reaches. Every row reads
all of its selected pages but the last one in full, so its length follows from the request's length
alone (:func:`selected_lens`): the host knows the lists' sizes without a sync, which FlashInfer's
host-side plan needs. :func:`expand_pages` writes them as slot lists; :func:`selected_positions_mask`
gives the same selection as a mask over positions (the CPU server's attention path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = float("-inf")


def page_counts(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return (seq_lens + page_size - 1) // page_size


def selected_lens(seq_lens: torch.Tensor, page_size: int, num_pages: int) -> torch.Tensor:
    """Tokens in each row's selection (every KV head the same): ``min(num_pages, pages)`` pages, all full
    but the row's last one. Works on host and device tensors alike."""
    pages = page_counts(seq_lens, page_size)
    last = seq_lens - (pages - 1) * page_size
    return (torch.clamp(pages, max=num_pages) - 1).clamp(min=0) * page_size + last * (pages > 0)


def select_pages(scores: torch.Tensor, num_pages: int) -> torch.Tensor:
    """The top ``num_pages`` pages of each row, ascending (``[rows, num_pages]`` int64); a row with fewer
    pages has its unused entries at ``scores.shape[1]`` (sorted last). Static shapes, no host sync."""
    k = min(num_pages, scores.shape[1])
    vals, idx = torch.topk(scores, k, dim=1, sorted=False)
    idx = torch.where(vals == NEG, torch.full_like(idx, scores.shape[1]), idx)
    return torch.sort(idx, dim=1).values


@triton.jit
def _expand_kernel(pages, req_to_token, req_pool_indices, seq_lens, indptr, out, num_sel, stride_r2t: tl.constexpr,
                   HKV: tl.constexpr, PAGE: tl.constexpr, FLATTEN: tl.constexpr):
    rh = tl.program_id(0)
    j = tl.program_id(1)
    i = rh // HKV
    h = rh % HKV
    n = tl.load(seq_lens + i)
    npages = (n + PAGE - 1) // PAGE
    p = tl.load(pages + rh.to(tl.int64) * num_sel + j)
    row = tl.load(req_pool_indices + i).to(tl.int64)
    offs = tl.arange(0, PAGE)
    pos = p * PAGE + offs
    m = (pos < n) & (p < npages)  # an unused entry (p == max_pages) writes nothing
    slot = tl.load(req_to_token + row * stride_r2t + pos, mask=m, other=0).to(tl.int64)
    if FLATTEN:
        slot = slot * HKV + h
    dst = tl.load(indptr + rh).to(tl.int64) + j * PAGE + offs
    tl.store(out + dst, slot.to(out.dtype.element_ty), mask=m)


def expand_pages(pages: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 seq_lens: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor, page_size: int,
                 flatten_heads: bool = True) -> None:
    """Row ``r = i * Hkv + h`` of ``pages`` (from :func:`select_pages`) as slots of request ``i`` at
    ``out[indptr[r]:]``, in page order, ``slot * Hkv + h`` when ``flatten_heads`` (FlashInfer's view of
    one KV head per row). ``indptr`` must hold the cumulated :func:`selected_lens`, per row."""
    rows, num_sel = pages.shape
    if rows == 0:
        return
    hkv = rows // req_pool_indices.shape[0]
    _expand_kernel[(rows, num_sel)](pages, req_to_token, req_pool_indices, seq_lens, indptr, out, num_sel,
                                    req_to_token.stride(0), HKV=hkv, PAGE=page_size, FLATTEN=flatten_heads)


def selected_positions_mask(pages: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int, page_size: int,
                            width: int) -> torch.Tensor:
    """The selection as a mask of logical positions, ``[bs, Hkv, width]`` bool (the CPU server's path)."""
    bs = seq_lens.shape[0]
    sel = pages.view(bs, num_kv_heads, -1)
    npages = (width + page_size - 1) // page_size
    chosen = torch.zeros(bs, num_kv_heads, npages + 1, dtype=torch.bool, device=pages.device)
    chosen.scatter_(2, torch.clamp(sel, max=npages), True)  # unused entries land in the spare column
    pos = torch.arange(width, device=pages.device)
    return chosen[:, :, pos // page_size] & (pos[None, None, :] < seq_lens[:, None, None])
