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


def randomize_scores(scores: torch.Tensor) -> torch.Tensor:
    """The selection methods' quality control (as kvpress's RandomPress is for eviction): random scores,
    keeping the forced (+inf) and absent (-inf) entries, so the same budget reads random tokens."""
    return torch.where(scores.isinf(), scores, torch.rand_like(scores))


def select_pages(scores: torch.Tensor, num_pages: int) -> torch.Tensor:
    """The top ``num_pages`` pages of each row, ascending (``[rows, num_pages]`` int64); a row with fewer
    pages has its unused entries at ``scores.shape[1]`` (sorted last). Static shapes, no host sync."""
    k = min(num_pages, scores.shape[1])
    vals, idx = torch.topk(scores, k, dim=1, sorted=False)
    idx = torch.where(vals == NEG, torch.full_like(idx, scores.shape[1]), idx)
    return torch.sort(idx, dim=1).values


# Rows up to this width are held in registers through the whole search (one load); wider rows are
# re-read from memory (L2) in SELECT_CHUNK pieces on every pass.
SELECT_MAX_BLOCK = 16384
SELECT_CHUNK = 4096
_KEY_NEG_INF: tl.constexpr = tl.constexpr(-2139095041)  # _keys(-inf): the least key but negative NaNs


@triton.jit
def _keys(row, start, n, BLOCK: tl.constexpr):
    """Scores ``row[start:start + BLOCK]`` as int32 keys ordered like the floats (negatives' value bits
    flipped; -0 joins +0, as the two compare equal); entries at or past ``n`` are not read and key as -inf."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(row + offs, mask=offs < n, other=float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def _digit_hist(row, n, keys, prefix, SHIFT: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """Histogram (256 bins) of the key byte at ``SHIFT`` over the row's selectable entries (above -inf) whose
    higher bytes equal ``prefix``'s; the top byte (``SHIFT`` 24) as a signed byte moved to 0..255, so that
    bin order is key order."""
    if ONE_BLOCK:
        hist = _hist_block(keys, prefix, SHIFT)
    else:
        hist = tl.zeros((256,), tl.int32)
        for start in range(0, n, BLOCK):
            hist += _hist_block(_keys(row, start, n, BLOCK), prefix, SHIFT)
    return hist


@triton.jit
def _hist_block(keys, prefix, SHIFT: tl.constexpr):
    cand = keys > _KEY_NEG_INF
    if SHIFT == 24:
        digit = (keys >> 24) + 128
    else:
        cand = cand & ((keys >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        digit = (keys >> SHIFT) & 255
    return tl.histogram(digit, 256, mask=cand)


@triton.jit
def _radix_pass(row, n, keys, prefix, need, above, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                ONE_BLOCK: tl.constexpr):
    """One byte of the k-th largest key: the largest bin ``b`` with at least ``need`` candidates at or above
    it; the candidates above ``b`` are taken (``above``), ``need`` shrinks by them, ``b`` joins ``prefix``."""
    hist = _digit_hist(row, n, keys, prefix, SHIFT, BLOCK, ONE_BLOCK)
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    b = tl.maximum(tl.max(tl.where(at_or_above >= need, bins, -1), axis=0), 0)
    gt = tl.sum(tl.where(bins > b, hist, 0), axis=0)
    if SHIFT == 24:
        prefix = (b - 128) << 24
    else:
        prefix = prefix | (b << SHIFT)
    return prefix, need - gt, above + gt


@triton.jit
def _select_kernel(scores, counts, out, width, stride_s, k, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
                   ROWS_PER_COUNT: tl.constexpr, PAGE: tl.constexpr):
    """One program per row: the k-th largest key by radix select (4 passes of one byte), then the chosen
    positions written in order."""
    r = tl.program_id(0)
    row = scores + r.to(tl.int64) * stride_s
    out_row = out + r.to(tl.int64) * k
    n = tl.minimum(tl.cdiv(tl.load(counts + r // ROWS_PER_COUNT).to(tl.int32), PAGE), width)
    if ONE_BLOCK:
        keys = _keys(row, 0, n, BLOCK)
    else:
        keys = tl.zeros((BLOCK,), tl.int32)  # unused: each pass re-reads the row
    # Each pass: a 256-bin histogram of one key byte among the entries that share the bytes chosen so far.
    # The first version bisected the key range instead (up to 32 counting passes): 45 us a layer for 5 x 32K
    # Quest rows on the H200 (benchmarks/results/2026-12-03-device-d/questdiag-profile.txt).
    prefix = n * 0
    need = n * 0 + k
    above = n * 0
    prefix, need, above = _radix_pass(row, n, keys, prefix, need, above, 24, BLOCK, ONE_BLOCK)
    prefix, need, above = _radix_pass(row, n, keys, prefix, need, above, 16, BLOCK, ONE_BLOCK)
    prefix, need, above = _radix_pass(row, n, keys, prefix, need, above, 8, BLOCK, ONE_BLOCK)
    prefix, need, above = _radix_pass(row, n, keys, prefix, need, above, 0, BLOCK, ONE_BLOCK)
    m = tl.sum(_digit_hist(row, n, keys, prefix, 24, BLOCK, ONE_BLOCK), axis=0)  # selectable: real, above -inf
    # A row of at most k selectable entries takes all of them (t = key(-inf), no ties: -inf is never taken).
    small = m <= k
    t = tl.where(small, _KEY_NEG_INF, prefix)
    need = tl.where(small, 0, need)  # entries equal to t to take, earliest first
    taken = tl.minimum(m, k)
    carry = taken * 0
    ties = taken * 0
    for start in range(0, n, BLOCK):
        if not ONE_BLOCK:
            keys = _keys(row, start, n, BLOCK)
        offs = start + tl.arange(0, BLOCK)
        tie = (keys == t) & (offs < n)
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) + ties  # 1-based among the row's ties
        take = (keys > t) | (tie & (tie_rank <= need))
        dst = tl.cumsum(take.to(tl.int32), axis=0) - 1 + carry
        tl.store(out_row + dst, offs.to(tl.int64), mask=take)
        carry += tl.sum(take.to(tl.int32), axis=0)
        ties += tl.sum(tie.to(tl.int32), axis=0)
    for start in range((taken // BLOCK) * BLOCK, k, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_row + offs, tl.full((BLOCK,), 0, tl.int64) + width, mask=(offs >= taken) & (offs < k))


def select_pages_triton(scores: torch.Tensor, num_pages: int, counts: torch.Tensor, rows_per_count: int = 1,
                        page_size: int = 1) -> torch.Tensor:
    """:func:`select_pages` as one Triton program per row, for rows whose first
    ``ceil(counts[r // rows_per_count] / page_size)`` entries are real (the rest is neither read nor selected;
    Quest passes the sequence lengths, its KV heads' rows and its page size, so that no kernel computes page
    counts per layer): the same output when the row's ``num_pages``-th largest score is not tied with an
    unselected one; on ties, the earliest positions win.

    ``torch.topk`` + ``torch.sort`` spends most of its time sorting; a selection needs neither. The row's
    ``k``-th largest score ``t`` is found by radix select on the scores' int32 keys (ordered like the
    floats): four passes, each a 256-bin histogram of one key byte among the entries sharing the bytes
    chosen so far, over a row held in registers up to ``SELECT_MAX_BLOCK`` entries, re-read in chunks past it. The
    entries ``> t`` and the first ties ``== t`` are then written in position order by a running prefix
    count, so no sort is needed. ``-inf`` entries are never selected (as :func:`select_pages` maps them to
    the unused value). Static shapes, no host sync (CUDA-graph safe)."""
    rows, width = scores.shape
    k = min(num_pages, width)
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows == 0 or k == 0:
        return out
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    one_block = width <= SELECT_MAX_BLOCK
    block = triton.next_power_of_2(width) if one_block else SELECT_CHUNK
    _select_kernel[(rows,)](scores, counts, out, width, scores.stride(0), k, BLOCK=block, ONE_BLOCK=one_block,
                            ROWS_PER_COUNT=rows_per_count, PAGE=page_size, num_warps=max(1, min(16, block // 512)))
    return out


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
