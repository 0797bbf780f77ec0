"""Compacted KV index lists: skip sentinel slots of ``req_to_token`` rows (Triton, no host sync).

SGLang's Triton attention reads K/V through ``kv_indptr``/``kv_indices`` (one slot per attended
token). For a request whose row holds sentinels (evicted positions, slot 0), these kernels write only
its live slots, in logical order, so attention cost follows the retained tokens:

    counts[i]      = #live slots in row[req_pool_indices[i], :seq_lens[i]]
    kv_indptr[1:]  = cumsum(counts)
    kv_indices[kv_indptr[i]:kv_indptr[i+1]] = the live slots

An empty list (a matched prefix whose positions are all evicted) stays empty: FlashInfer and the
Triton extend kernel handle a zero-length prefix. Only the Triton *decode* kernel needs one slot per
row, for CUDA-graph padding rows (``req_pool_idx`` 0, all padding): ``min_one=True`` gives such a row
the padding slot. A real decode row always holds its own new token, so it never takes that path.

Decode steps fix every row's list length (the runtime's device table ``live_len``, see
``integration/tables.py``, from the same host counters as FlashInfer's host-side plan): given
``counts``, ``kv_indptr`` is built from them, so the device lists and the host plan agree by
construction, and a count that disagrees with the row is counted in ``mismatches`` (reported, not
silently served). The writing pass never leaves a row's ``[indptr[i], indptr[i+1])`` range, pads a
range it could not fill with the padding slot, and counts are capped at ``seq_lens`` (what the stock
code sizes ``kv_indices`` by), so even a wrong count cannot make attention read out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.slots import SENTINEL_SLOT

BLOCK = 1024  # row positions per program


@triton.jit
def _block_count_kernel(req_to_token, req_pool_indices, seq_lens, block_counts, nblk, stride: tl.constexpr,
                        SENTINEL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (rows, blocks): live slots in block ``blk`` of a row's first ``seq_len`` positions."""
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    row = tl.load(req_pool_indices + pid).to(tl.int64)
    n = tl.load(seq_lens + pid)
    offs = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    v = tl.load(req_to_token + row * stride + offs, mask=(offs < n) & (offs < stride), other=SENTINEL)
    tl.store(block_counts + pid * nblk + blk, tl.sum((v != SENTINEL).to(tl.int32), axis=0))


@triton.jit
def _block_compact_kernel(req_to_token, req_pool_indices, seq_lens, kv_indptr, block_offsets, row_live, kv_indices,
                          nblk, stride: tl.constexpr, SENTINEL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (rows, blocks): block ``blk``'s live slots, in order, at the row's list start plus the live
    slots of the blocks before it; never past the row's range. Block 0 also pads the rest of the
    range (beyond the row's live slots) with the padding slot."""
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    row = tl.load(req_pool_indices + pid).to(tl.int64)
    n = tl.load(seq_lens + pid)
    out = tl.load(kv_indptr + pid).to(tl.int64)
    end = tl.load(kv_indptr + pid + 1).to(tl.int64)
    offs = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    v = tl.load(req_to_token + row * stride + offs, mask=(offs < n) & (offs < stride), other=SENTINEL)
    live = v != SENTINEL
    dst = out + tl.load(block_offsets + pid * nblk + blk).to(tl.int64) + tl.cumsum(live.to(tl.int32), axis=0) - 1
    tl.store(kv_indices + dst, v.to(kv_indices.dtype.element_ty), mask=live & (dst < end))
    if blk == 0:
        # A CUDA-graph padding row's one slot (min_one); nothing when the count was right.
        for start in range(out + tl.load(row_live + pid).to(tl.int64), end, BLOCK_N):
            pad = start + tl.arange(0, BLOCK_N)
            tl.store(kv_indices + pad, tl.full((BLOCK_N,), SENTINEL, dtype=kv_indices.dtype.element_ty),
                     mask=pad < end)


def fill_compact_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                            kv_indptr: torch.Tensor, kv_indices: torch.Tensor, min_one: bool = False,
                            counts: torch.Tensor | None = None,
                            mismatches: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``kv_indptr[: bs + 1]`` and the compacted ``kv_indices``; returns ``kv_indptr[: bs + 1]``.

    The list lengths are the live slots counted here, or ``counts`` (device, ``[bs]``) when the caller
    fixes them (a decode step's live counts, which FlashInfer's host-side plan uses too), capped at
    ``seq_lens`` so the lists never outgrow a buffer sized by them; ``min_one``: at least one for a
    non-empty row, either way; then ``mismatches`` (device, one element) gains the number of rows whose given count
    differs from the counted one, a bookkeeping error the caller reports without a sync. One program
    per block of 1024 row positions (a 130K row is 128 programs, not one program looping 128 times;
    blocks past a row's length load nothing). No host sync: everything stays on the device (so it
    also runs inside CUDA-graph replays)."""
    bs = int(req_pool_indices.shape[0])
    indptr = kv_indptr[: bs + 1]
    indptr[:1].zero_()  # not ``indptr[0] = 0``: a Python scalar into a CUDA tensor is a blocking copy (a sync)
    if bs == 0:
        return indptr
    device = req_to_token.device
    nblk = triton.cdiv(req_to_token.shape[1], BLOCK)
    block_counts = torch.empty((bs, nblk), dtype=torch.int32, device=device)
    _block_count_kernel[(bs, nblk)](req_to_token, req_pool_indices, seq_lens, block_counts, nblk,
                                    req_to_token.stride(0), SENTINEL=SENTINEL_SLOT, BLOCK_N=BLOCK)
    ends = torch.cumsum(block_counts, dim=1, dtype=torch.int32)
    row_live = ends[:, -1].contiguous()
    block_offsets = ends - block_counts
    floor = torch.clamp(seq_lens, max=1).to(torch.int32) if min_one else None
    counted = row_live if floor is None else torch.maximum(row_live, floor)
    if counts is None:
        counts = counted
    else:
        counts = counts.to(torch.int32)
        if floor is not None:
            counts = torch.maximum(counts, floor)
        counts = torch.minimum(counts, seq_lens.to(torch.int32))
        if mismatches is not None:
            mismatches += (counts != counted).sum().to(mismatches.dtype)
    indptr[1:] = torch.cumsum(counts, dim=0)
    _block_compact_kernel[(bs, nblk)](req_to_token, req_pool_indices, seq_lens, indptr, block_offsets, row_live,
                                      kv_indices, nblk, req_to_token.stride(0), SENTINEL=SENTINEL_SLOT,
                                      BLOCK_N=BLOCK)
    return indptr


def compact_kv_indices_reference(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor, min_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`fill_compact_kv_indices` (for tests)."""
    indptr, out = [0], []
    for r, n in zip(req_pool_indices.tolist(), seq_lens.tolist()):
        row = req_to_token[r, :n]
        live = row[row != SENTINEL_SLOT]
        if min_one and n > 0 and live.numel() == 0:
            live = torch.zeros(1, dtype=row.dtype)
        out.append(live)
        indptr.append(indptr[-1] + live.numel())
    return torch.tensor(indptr), torch.cat(out) if out else torch.empty(0, dtype=req_to_token.dtype)
