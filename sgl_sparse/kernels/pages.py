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
# Dtypes the selection scoring kernels' tensor-core forms (Quest's page scores, OmniKV's token scores) read as they
# are: their default path for summaries / K caches of these dtypes.
MMA_SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
def _count_ge(row, n, keys, tkeys, mid, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """Entries of the row whose key is ``>= mid``."""
    if ONE_BLOCK:
        c = tl.sum((keys >= mid).to(tl.int32), axis=0)
        if TAIL > 0:
            c += tl.sum((tkeys >= mid).to(tl.int32), axis=0)
    else:
        acc = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, n, BLOCK):
            acc += (_keys(row, start, n, BLOCK) >= mid).to(tl.int32)
        c = tl.sum(acc, axis=0)
    return c


@triton.jit
def _taken(keys, offs, n, t, need, ties):
    """Which of a block's entries (positions ``offs``) a threshold takes: above ``t``, or among the first ``need``
    ties of the row (``ties`` seen in earlier blocks); -> (mask, ties seen after this block)."""
    tie = (keys == t) & (offs < n)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) + ties  # 1-based among the row's ties
    take = (keys > t) | (tie & (tie_rank <= need))
    return take, ties + tl.sum(tie.to(tl.int32), axis=0)


@triton.jit
def _write_taken(out_row, keys, start, n, t, need, carry, ties, BLOCK: tl.constexpr):
    """Positions ``start..start + BLOCK`` of the row taken (above ``t``, or among the first ``need`` ties
    of the row), written after the ``carry`` already written; -> (carry, ties seen) after this block."""
    offs = start + tl.arange(0, BLOCK)
    take, ties = _taken(keys, offs, n, t, need, ties)
    dst = tl.cumsum(take.to(tl.int32), axis=0) - 1 + carry
    tl.store(out_row + dst, offs.to(tl.int64), mask=take)
    return carry + tl.sum(take.to(tl.int32), axis=0), ties


@triton.jit
def _kth_key(row, n, keys, tkeys, k, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """The row's threshold for its ``k`` largest selectable (above ``-inf``) entries: ``(t, need, m)``,
    take every key ``> t`` and the first ``need`` keys ``== t``; ``m`` selectable entries (a row of at most
    ``k`` takes all of them at ``t = key(-inf)``, ``need = 0``). Bisection on the int32 keys."""
    kmin = _KEY_NEG_INF + 1
    m = _count_ge(row, n, keys, tkeys, kmin, BLOCK, ONE_BLOCK, TAIL)  # selectable entries: real, above -inf
    # Invariants: count(key >= lo) >= k and count(key > hi) == above; the threshold t lies in [lo, hi].
    small = m <= k
    lo = tl.where(small, kmin - 1, kmin).to(tl.int64)
    hi = tl.where(small, kmin - 1, 2147483647).to(tl.int64)
    above = tl.where(small, m, 0)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2  # in (lo, hi]: every pass shrinks the interval
        c = _count_ge(row, n, keys, tkeys, mid.to(tl.int32), BLOCK, ONE_BLOCK, TAIL)
        # c == k: the entries >= mid are the selection; stop at t = mid - 1 with no ties to take.
        lo = tl.where(c > k, mid, tl.where(c == k, mid - 1, lo))
        hi = tl.where(c > k, hi, mid - 1)
        above = tl.where(c > k, above, c)
    need = tl.where(small, 0, k - above)  # entries equal to t to take, earliest first
    return lo.to(tl.int32), need, m


@triton.jit
def _row_keys(row, n, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """A row's keys held in registers (its main block and its tail) when ``ONE_BLOCK``; placeholders
    otherwise (each pass re-reads the row)."""
    if ONE_BLOCK:
        keys = _keys(row, 0, n, BLOCK)
        if TAIL > 0:  # a width just past a power of two (SGLang's rows are context + 4 wide) keeps a small tail
            tkeys = _keys(row, BLOCK, n, TAIL)
        else:
            tkeys = keys
    else:
        keys = tl.zeros((BLOCK,), tl.int32)
        tkeys = keys
    return keys, tkeys


@triton.jit
def _select_kernel(scores, counts, out, width, stride_s, k, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
                   TAIL: tl.constexpr, ROWS_PER_COUNT: tl.constexpr, PAGE: tl.constexpr):
    """One program per row: bisect the k-th largest key, then write the chosen positions in order."""
    r = tl.program_id(0)
    row = scores + r.to(tl.int64) * stride_s
    out_row = out + r.to(tl.int64) * k
    n = tl.minimum(tl.cdiv(tl.load(counts + r // ROWS_PER_COUNT).to(tl.int32), PAGE), width)
    keys, tkeys = _row_keys(row, n, BLOCK, ONE_BLOCK, TAIL)
    t, need, m = _kth_key(row, n, keys, tkeys, k, BLOCK, ONE_BLOCK, TAIL)
    taken = tl.minimum(m, k)
    carry = taken * 0
    ties = taken * 0
    if ONE_BLOCK:
        carry, ties = _write_taken(out_row, keys, 0, n, t, need, carry, ties, BLOCK)
        if TAIL > 0:
            carry, ties = _write_taken(out_row, tkeys, BLOCK, n, t, need, carry, ties, TAIL)
    else:
        for start in range(0, n, BLOCK):
            carry, ties = _write_taken(out_row, _keys(row, start, n, BLOCK), start, n, t, need, carry, ties, BLOCK)
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
    ``k``-th largest score ``t`` is found by bisection on the scores' int32 keys (ordered like the floats):
    each pass counts the entries ``>= mid`` (at most 32 passes; it stops early once exactly ``k`` are),
    over a row held in registers up to ``SELECT_MAX_BLOCK`` entries, re-read in chunks past it. A radix
    select (four 256-bin histogram passes of one key byte) is slower at Quest's long rows. The
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
    _select_kernel[(rows,)](scores, counts, out, width, scores.stride(0), k, ROWS_PER_COUNT=rows_per_count,
                            PAGE=page_size, **row_blocks(width))
    return out


def row_blocks(width: int) -> dict[str, int | bool]:
    """The bisection kernels' launch shape for rows ``width`` wide (``BLOCK``, ``ONE_BLOCK``, ``TAIL``,
    ``num_warps``). In registers up to ``SELECT_MAX_BLOCK``: the largest power of two within the width, and the
    rest as a tail block. A row of 8,193 pages (SGLang's req_to_token is context + 4 wide: 131,076 / 16) otherwise
    takes a 16,384-entry block, about twice as slow as 8,192 pages (benchmarks/selection_overhead.py). Wider
    rows: ``SELECT_CHUNK`` pieces re-read on every pass."""
    one_block = width <= SELECT_MAX_BLOCK
    block = 1 << (width.bit_length() - 1) if one_block else SELECT_CHUNK
    tail = triton.next_power_of_2(width - block) if one_block and width > block else 0
    return {"BLOCK": block, "ONE_BLOCK": one_block, "TAIL": tail, "num_warps": max(1, min(16, block // 512))}


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
