"""The sentinel slot: how an evicted logical position is written in ``req_to_token`` rows and tree values.

One module for it (kernels, tree, runtime and attention all import from here). It is SGLang's padding
slot 0, which the allocator never hands out (its free list is ``1..size``), so it can never be a live
slot. Pure torch: methods, kernels and tests use it without a server.
"""

from __future__ import annotations

import torch

SENTINEL_SLOT = 0


def live_slots(slots: torch.Tensor) -> torch.Tensor:
    """``slots`` without sentinels: what may be handed back to the allocator (data-dependent size: a
    host sync on GPU, so callers use it only where the size is not known on the host)."""
    return slots[slots != SENTINEL_SLOT]


def retained_positions(row: torch.Tensor) -> torch.Tensor:
    """Sorted logical positions of ``row`` that hold a live slot (CPU int64; a host sync on GPU)."""
    return (row != SENTINEL_SLOT).nonzero().flatten().cpu()


def complement(kept: torch.Tensor, n: int) -> torch.Tensor:
    """Sorted positions of ``[0, n)`` not in the sorted CPU tensor ``kept``."""
    mask = torch.ones(n, dtype=torch.bool)
    mask[kept[kept < n]] = False
    return mask.nonzero().flatten()


def write_sentinels(t: torch.Tensor, index: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
    """``t[index] = SENTINEL_SLOT`` without a host sync. PyTorch stages a Python scalar written into a
    CUDA tensor in host memory and copies it with a blocking host-to-device copy, which waits for the
    stream (the whole forward in flight); a device scalar is a fill kernel, no wait."""
    t[index] = torch.full((), SENTINEL_SLOT, dtype=t.dtype, device=t.device)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host -> device without blocking the host: a plain ``.to(cuda)`` of pageable memory waits for
    the stream (``cudaStreamSynchronize``), which would stall overlap scheduling; pinned staging with
    ``non_blocking`` does not (the caching host allocator keeps the staging buffer until the copy ran)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
