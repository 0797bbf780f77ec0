"""Process-wide runtime of a scheduler process: the method instance, built once from the hand-off.

Scheduler, tree and model runner share one process (per TP rank), so module state is the natural
place for what they share. Methods import nothing from SGLang; this is where they meet it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_sparse.contract import SparseMethod
from sgl_sparse.integration import handoff
from sgl_sparse.registry import create_method


@dataclass
class SparseRuntime:
    method: SparseMethod[Any]
    fingerprint: str


_runtime: SparseRuntime | None = None


def get_runtime() -> SparseRuntime:
    """Build (first call) or return this process's runtime. Config errors raise here, loudly."""
    global _runtime
    if _runtime is None:
        h = handoff.read()
        method = create_method(h.method, h.config)
        _runtime = SparseRuntime(method=method, fingerprint=method.config.fingerprint())
    return _runtime
