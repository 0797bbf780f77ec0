"""Relocation: after a request's prompt-end eviction, its kept KV moves into contiguous slots.

A 130K prompt occupies ~130K slots; SnapKV keeps 8K of them, spread over that whole range in runs of
a few tokens. Decode then reads each kept token's K and V rows (2 KB per layer for Llama-3-8B) from
scattered places, which costs FlashInfer's decode kernel bandwidth against vanilla's nearly contiguous
slots (``benchmarks/attention_layout.py`` measures it). So at the plan that ends a request's prefill
(the one large eviction of its life) the runtime also moves the kept KV it owns:

* the request-owned part only (positions ``>= cache_protected_len``; tree-owned prefix slots are shared
  and stay where they are);
* targets: the smallest ``m`` of the slots the request owned before the plan (``m``: owned kept
  positions), in position order, so the kept set becomes one ascending run where its prompt was
  allocated in one; the other slots are the ones freed (the same count the plan drops);
* the copy is SGLang's own ``move_kv_cache_native`` (per layer ``buf[tgt] = buf[src]``, which gathers
  the sources before it writes, so targets that are also sources of later positions are safe), on the
  forward stream right after the forward that wrote the KV, before the row update and the frees, which
  :mod:`.frees` orders against the schedule stream as for any eviction.

Batched over the step's requests from host-side sizes (no device sync). It costs one read and one write
of the kept KV, once per request (8K tokens x 128 KiB = 1 GiB for Llama-3-8B, well under a millisecond
on an H200). Decode-time plans (StreamingLLM's rolling window, SnapKV re-selection) are small and leave
the layout as it is. ``SGLSPARSE_RELOCATE=0`` turns it off (benchmarks compare both); pools whose
layout we do not move (quantized with scale buffers, HND, MLA) are left as they are, said once in the log.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.slots import to_device

logger = logging.getLogger(__name__)

ENV = "SGLSPARSE_RELOCATE"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def pool_supported(pool: Any) -> bool:
    """A token-major MHA pool of per-layer ``[slots, heads, dim]`` buffers and nothing beside them."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return (type(pool) is MHATokenToKVPool and not getattr(pool, "use_hnd", False)
            and getattr(pool, "k_scale_buffer", None) is None and isinstance(getattr(pool, "k_buffer", None), list))


@dataclass
class Move:
    """One request's relocation, host side: its ``req_to_token`` row, the owned positions it held
    before the plan (sorted) and the owned positions it keeps (sorted, a subset)."""

    row: int
    owned_before: torch.Tensor
    owned_kept: torch.Tensor


def relocate(req_to_token: torch.Tensor, pool: Any, moves: list[Move]) -> torch.Tensor:
    """Move each request's kept owned KV into the smallest of its owned slots (position order), update
    the rows, and return the slots no longer used (to free; device, int64). Call before the sentinel
    writes of the same plans: it reads the rows' slots of ``owned_before``."""
    from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

    device = req_to_token.device
    moves = sorted(moves, key=lambda m: m.row)  # the sort below groups by row in ascending order
    n_before = [int(m.owned_before.numel()) for m in moves]
    n_kept = [int(m.owned_kept.numel()) for m in moves]
    rows_b = torch.cat([torch.full((n,), m.row, dtype=torch.int64) for m, n in zip(moves, n_before)])
    rows_k = torch.cat([torch.full((n,), m.row, dtype=torch.int64) for m, n in zip(moves, n_kept)])
    pos_b = torch.cat([m.owned_before for m in moves])
    pos_k = torch.cat([m.owned_kept for m in moves])
    rows_bd, rows_kd = to_device(rows_b, device), to_device(rows_k, device)
    before = req_to_token[rows_bd, to_device(pos_b, device)].long()
    # Sort each request's slots within its own group: key = row, then slot (slots < 2**32).
    ordered = torch.sort(rows_bd * (1 << 32) + before).values & ((1 << 32) - 1)
    starts = torch.tensor([0, *n_before], dtype=torch.int64).cumsum(0)[:-1].tolist()
    take = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, n_kept)])
    rest = torch.cat([torch.arange(s + k, s + n) for s, k, n in zip(starts, n_kept, n_before)])
    targets = ordered[to_device(take, device)]
    pos_kd = to_device(pos_k, device)
    sources = req_to_token[rows_kd, pos_kd].long()
    move_kv_cache_native(pool.k_buffer, pool.v_buffer, targets, sources)
    req_to_token[rows_kd, pos_kd] = targets.to(req_to_token.dtype)
    return ordered[to_device(rest, device)]
