"""Which of our attention backends a model runner gets: the base (SGLang's backend ours wraps) chosen from the
server's flags, and the checks that refuse a model or layout a base cannot serve, with the reason. The backends:
:mod:`.attention` (the shared mixin, torch_native and triton bases) and :mod:`.flashinfer_backend`."""

from __future__ import annotations

import os
from typing import Any

import torch

from sgl_sparse.integration import handoff
from sgl_sparse.integration.attention import (
    BASES,
    SparseBackendMixin,
    SparseTorchNativeBackend,
    SparseTritonBackend,
)
from sgl_sparse.integration.runtime import get_runtime

# Models that fuse the K/V write into RoPE on CUDA with a bf16 pool (sglang/srt/models/*.py, 0.5.17).
FUSED_KV_WRITE_MODELS = frozenset({"qwen3_moe", "gpt_oss", "bailing_moe", "mellum", "sdar", "sdar_moe", "llada2"})
IMPL_ENV = "SGLSPARSE_ATTENTION_IMPL"  # overrides the base, for tests: torch_native | triton | flashinfer


def choose_base(model_runner: Any) -> str:
    """The launcher's choice (``handoff.base``), else by device; ``SGLSPARSE_ATTENTION_IMPL`` wins
    (``triton`` on CPU runs the GPU path under ``TRITON_INTERPRET=1``, which is how CI tests it)."""
    impl = os.environ.get(IMPL_ENV) or handoff.read().base
    if impl in (None, "", "auto"):
        return "torch_native" if getattr(model_runner, "device", None) == "cpu" else "flashinfer"
    impl = {"torch": "torch_native"}.get(impl, impl)
    if impl not in BASES:
        raise ValueError(f"sgl_sparse: attention base {impl!r} is not supported; expected one of {', '.join(BASES)}")
    return impl


def checkpoint_kv_dtype_problem(model_runner: Any) -> str | None:
    """Why the KV dtype SGLang resolved is not the one the launcher checked, or None. Under ``--kv-cache-dtype
    auto`` an FP8 checkpoint's quant config (``kv_cache_quant_algo``, mem_cache/kv_cache_dtype.py L32-40) makes
    the pool FP8, where the launcher's checks (which methods read raw keys) took the model dtype."""
    flag = str(getattr(model_runner.server_args, "kv_cache_dtype", None) or "auto")
    dtype = getattr(model_runner, "kv_cache_dtype", None)
    if flag == "auto" and isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize == 1:
        return (f"sgl_sparse: the checkpoint's quantization config makes the KV cache {dtype} under "
                "--kv-cache-dtype auto, which sgl_sparse's launch checks took for the model dtype: pass "
                "--kv-cache-dtype fp8_e4m3 (each method then serves or refuses FP8 KV by name) or bf16")
    return None


def create_backend(model_runner: Any) -> SparseBackendMixin:
    """Factory for ``register_attention_backend``."""
    if (why := checkpoint_kv_dtype_problem(model_runner)) is not None:
        raise ValueError(why)
    base = choose_base(model_runner)
    method = get_runtime().method
    if method.store is not None and method.evicts and model_runner.device != "cpu" and base != "flashinfer":
        raise ValueError(f"sgl_sparse: {method.name} (eviction over a method-owned layout) reads FlashInfer's "
                         "compacted decode lists on CUDA: use --attention-backend flashinfer")
    if method.selector is not None and base == "triton":
        raise ValueError(f"sgl_sparse: {method.name}'s decode reads a selection, which the flashinfer base (GPU) "
                         "and torch_native (CPU) serve, not triton")
    if method.store is not None and base == "triton":
        raise ValueError(f"sgl_sparse: {method.name} (a method-owned KV layout) serves on the flashinfer base "
                         "(GPU) or torch_native (CPU), not triton")
    arch = type(model_runner.model).__module__.rsplit(".", 1)[-1]
    if method.store is not None and arch in FUSED_KV_WRITE_MODELS and model_runner.device != "cpu":
        raise ValueError(f"sgl_sparse: {method.name} cannot serve {arch}: on CUDA that model writes K/V into "
                         "SGLang's bf16 buffers inside its RoPE kernel (models/utils.py enable_fused_set_kv_buffer), "
                         "bypassing a method-owned layout")
    if (method.evicts or method.store is not None) and getattr(model_runner, "sliding_window_size", None):
        raise ValueError(f"sgl_sparse: sliding-window models are not supported with {get_runtime().method.name} "
                         "(the window counts logical positions, the compacted KV lists do not)")
    if base == "torch_native":
        return SparseTorchNativeBackend(model_runner)
    if model_runner.model_config.is_encoder_decoder:
        raise ValueError("sgl_sparse: encoder-decoder models are not supported (no cross attention)")
    if base == "triton":
        return SparseTritonBackend(model_runner)
    from sgl_sparse.integration.flashinfer_backend import SparseFlashInferBackend

    return SparseFlashInferBackend(model_runner)
