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

Decode steps know every row's live count already (the runtime's device table ``live_len``, see
``integration/tables.py``): given ``counts``, the counting pass is skipped and the lists are built in
one pass. The writing pass never leaves a row's ``[indptr[i], indptr[i+1])`` range and pads a range it
could not fill with the padding slot, so even a wrong count cannot make attention read out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.slots import SENTINEL_SLOT

BLOCK = 1024


@triton.jit
def _count_live_kernel(req_to_token, req_pool_indices, seq_lens, counts, stride: tl.constexpr,
                       SENTINEL: tl.constexpr, MIN_ONE: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices + pid).to(tl.int64)
    n = tl.load(seq_lens + pid)
    acc = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        v = tl.load(req_to_token + row * stride + offs, mask=offs < n, other=SENTINEL)
        acc += tl.sum((v != SENTINEL).to(tl.int32), axis=0)
    if MIN_ONE:
        acc = tl.maximum(acc, tl.minimum(n, 1).to(tl.int32))
    tl.store(counts + pid, acc)


@triton.jit
def _compact_kernel(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, stride: tl.constexpr,
                    SENTINEL: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices + pid).to(tl.int64)
    n = tl.load(seq_lens + pid)
    out = tl.load(kv_indptr + pid).to(tl.int64)
    end = tl.load(kv_indptr + pid + 1).to(tl.int64)
    written = tl.zeros((), dtype=tl.int64)
    for start in range(0, n, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        v = tl.load(req_to_token + row * stride + offs, mask=offs < n, other=SENTINEL)
        live = v != SENTINEL
        pos = tl.cumsum(live.to(tl.int32), axis=0) - 1
        dst = out + written + pos
        tl.store(kv_indices + dst, v.to(kv_indices.dtype.element_ty), mask=live & (dst < end))
        written += tl.sum(live.to(tl.int32), axis=0).to(tl.int64)
    # The rest of the range (a padding row's one slot under MIN_ONE; none when the count was right)
    # reads the padding slot.
    for start in range(out + written, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        tl.store(kv_indices + offs, tl.full((BLOCK_N,), SENTINEL, dtype=kv_indices.dtype.element_ty),
                 mask=offs < end)


def fill_compact_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                            kv_indptr: torch.Tensor, kv_indices: torch.Tensor, min_one: bool = False,
                            counts: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``kv_indptr[: bs + 1]`` and the compacted ``kv_indices``; returns ``kv_indptr[: bs + 1]``.
    ``counts`` (device, ``[bs]``): each row's live count when the caller knows it (the count kernel's
    output otherwise, ``min_one`` included). No host sync: everything stays on the device (so it also
    runs inside CUDA-graph replays)."""
    bs = int(req_pool_indices.shape[0])
    if counts is None:
        counts = torch.empty(bs, dtype=torch.int32, device=req_to_token.device)
        if bs:
            _count_live_kernel[(bs,)](req_to_token, req_pool_indices, seq_lens, counts, req_to_token.stride(0),
                                      SENTINEL=SENTINEL_SLOT, MIN_ONE=min_one, BLOCK_N=BLOCK)
    indptr = kv_indptr[: bs + 1]
    indptr[0] = 0
    indptr[1:] = torch.cumsum(counts, dim=0)
    if bs:
        _compact_kernel[(bs,)](req_to_token, req_pool_indices, seq_lens, indptr, kv_indices,
                               req_to_token.stride(0), SENTINEL=SENTINEL_SLOT, BLOCK_N=BLOCK)
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
