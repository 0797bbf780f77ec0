"""CPU fallbacks SGLang 0.5.17 lacks, applied only in processes of a ``--device cpu`` server.

1. RoPE: ``RotaryEmbedding.__init__`` (layers/rotary_embedding/base.py L103-124) imports
   ``vllm._custom_ops`` when no platform flag matches, and a CUDA build of torch on a machine without
   GPU matches none. The module global ``_is_cpu`` is read at construction time, so setting it in the
   scheduler process (our plug-in runs first thing in ``run_scheduler_process``, before the model is
   built) selects the native path. Dispatch stays ``forward_native``.
2. Name-based Triton dispatch: ``utils.common.support_triton(name)`` decides between Triton and torch
   helper kernels (``write_cache_indices``, ``compute_position``) by the attention backend's *name*;
   our backend's name is not ``torch_native``, so on CPU it must answer False for it too.
"""

from __future__ import annotations

import logging

from sgl_sparse.integration import BACKEND_NAME

logger = logging.getLogger(__name__)

_TORCH_ONLY_BACKENDS = ("torch_native", "intel_amx", BACKEND_NAME)


def support_triton_cpu(backend: str) -> bool:
    """Replacement for ``sglang.srt.utils.common.support_triton`` on CPU servers."""
    return backend not in _TORCH_ONLY_BACKENDS


def register_cpu_support() -> None:
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    rope_base._is_cpu = True
    HookRegistry.register("sglang.srt.utils.common.support_triton", support_triton_cpu, HookType.REPLACE)
    logger.info("sgl_sparse: CPU support active (native RoPE, torch helper kernels for %s)", BACKEND_NAME)
