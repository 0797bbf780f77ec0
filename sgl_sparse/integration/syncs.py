"""A check that a decode step's own work never waits for the GPU.

Every host sync in the per-step path stalls overlap scheduling: the GPU idles while the host prepares
the next step. ``SGLSPARSE_SYNC_DEBUG=warn|error`` runs our decode-step code (the runtime's hooks
around the forward and the KV-list build) under ``torch.cuda.set_sync_debug_mode``: a synchronizing
CUDA call there is logged with its stack (``warn``) or raises (``error``, which the GPU tests use).
Only our code is inside; SGLang's own syncs are not ours to flag. Prefill steps are left out: SnapKV's
selection copies its scores to the host once per request there, by design; so does a decode step that scores a
window (H2O, R-KV, SkipKV, SnapKV's ``decode_interval``: every ``window``/``interval`` tokens), whose observation
and plan run under :func:`allow_host_sync` (integration/step.py); the other decode steps stay checked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV = "SGLSPARSE_SYNC_DEBUG"
_MODE = os.environ.get(ENV) or None
if _MODE not in (None, "warn", "error"):
    raise ValueError(f"{ENV}={_MODE!r}: expected warn or error (or unset)")


@contextmanager
def sync_debug(mode: str | int) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block, the previous mode restored after it."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextmanager
def no_host_sync(active: bool = True) -> Iterator[None]:
    """Run the block under the sync check when ``SGLSPARSE_SYNC_DEBUG`` is set (else a no-op)."""
    if _MODE is None or not active or not torch.cuda.is_available():
        yield
        return
    with sync_debug(_MODE):
        yield


@contextmanager
def allow_host_sync() -> Iterator[None]:
    """Inside a checked block: a sync that is wanted (``SGLSPARSE_CHECK_TABLES``' own device check)."""
    if _MODE is None or not torch.cuda.is_available():
        yield
        return
    with sync_debug(0):
        yield
