"""What the runtime checks of a method, beside the contract it implements: which methods the server can serve,
the rules a :class:`~sgl_sparse.contract.KeepPlan` must satisfy, the pool page size a method is served with, and
which retained positions a request's own prune takes, and how many decode queries a request keeps. One module, so
the server (``integration/``) and the reference driver (:mod:`sgl_sparse.reference`) cannot drift. Imports only
torch, the contract and the prune spec's constants."""

from __future__ import annotations

from typing import Any

import torch

from sgl_sparse.contract import KeepPlan, SparseMethod
from sgl_sparse.prune.spec import SNAPKV_WINDOW


def pool_page_size(method: SparseMethod[Any]) -> int:
    """The KV pool page size ``method`` is served with: its selector's or its store's (page metadata and
    token groups need SGLang's paged allocator), else 1 (eviction frees single slots)."""
    if method.selector is not None:
        return method.selector.page_size
    return method.store.page_size if method.store is not None else 1


# The decode queries a request keeps, per layer, for methods requests choose (h2o's default window, the longest
# default of the methods that observe decode): --sparse-request-decode-window's default on CPU (0 on CUDA, where
# every request row's ring takes KV memory).
PER_REQUEST_DECODE_WINDOW = 128


def decode_window(method: SparseMethod[Any], request_window: int = 0) -> int:
    """The last queries a request keeps on the device, per layer, when its method observes decode (0: none
    observes): the longer of the server method's window and ``request_window`` (what methods chosen per request
    may observe), and at least the window a request's own prune reads (the same buffer holds its prompt's last
    queries). One width for the server: the buffer is written inside SGLang's decode CUDA graphs, by request row
    and position."""
    w = method.observation_window() if method.observation_window() > 0 and method.observes_decode() else 0
    w = max(w, request_window)
    return max(w, SNAPKV_WINDOW) if w > 0 else 0


def served_hooks_problem(method: SparseMethod[Any]) -> str | None:
    """Why the server runtime cannot serve ``method`` (``None``: it can)."""
    if method.store is not None and method.selector is not None:
        return (f"{method.name} has a KV store beside selection: a quantized pool under a selection method is not "
                "served yet")
    if method.store is not None and method.evicts and (why := method.store.eviction_problem()) is not None:
        return f"{method.name} evicts over {type(method.store).__name__}'s layout, which cannot be served: {why}"
    if not method.evicts and method.observation_window() == 0:
        hooks = ("new_state", "restore_state", "on_prefill_chunk", "on_prune", "wants_observation",
                 "on_observation", "on_step_end", "on_finish")
        overridden = [h for h in hooks if getattr(type(method), h) is not getattr(SparseMethod, h)]
        if overridden:
            return (f"{method.name} overrides per-request hooks ({', '.join(overridden)}) but neither evicts nor "
                    "observes, and the server drives them only for methods that do (so they would never run)")
    return None


def check_keep_plan(method: SparseMethod[Any], plan: KeepPlan, kept: torch.Tensor) -> torch.Tensor:
    """The contract's rules for a :class:`KeepPlan`, enforced by both the server runtime and the
    reference driver: only ``evicts`` methods return one; its positions are sorted, unique and currently
    retained. Returns the keep set as CPU int64."""
    if not method.evicts:
        raise RuntimeError(f"{method.name} returned a KeepPlan but does not declare evicts=True")
    keep = plan.keep.to(dtype=torch.int64, device="cpu")
    if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
        raise RuntimeError(f"{method.name}: KeepPlan positions must be sorted and unique")
    if keep.numel() and not bool(torch.isin(keep, kept).all()):
        raise RuntimeError(f"{method.name}: KeepPlan keeps positions that are not retained")
    return keep


def in_ranges(kept: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Which of the retained positions ``kept`` lie in ``ranges`` (logical ``[l, r)``): what a request's own
    prune hands :meth:`SparseMethod.on_prune`, for the server runtime and the reference driver alike."""
    drop = torch.zeros(kept.numel(), dtype=torch.bool)
    for lo, hi in ranges:
        drop |= (kept >= lo) & (kept < hi)
    return drop
