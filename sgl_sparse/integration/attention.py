"""Our attention backend (registered as ``sgl_sparse``).

It is the seam where sparse methods change which K/V attention reads: index lists that skip evicted
positions, per-layer selections, codecs. With the ``dense`` method it adds nothing to the stock
kernels it wraps, so output and speed equal vanilla SGLang:

* ``device == "cpu"``: :class:`SparseTorchNativeBackend` over SGLang's ``TorchNativeAttnBackend``.
* otherwise: :class:`SparseTritonBackend` over SGLang's ``TritonAttnBackend`` (CUDA graphs included).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

from sgl_sparse.contract import SparseMethod
from sgl_sparse.integration.runtime import get_runtime


class _SparseBackendMixin:
    """Shared identity of our backends: which method they serve (read by ``/server_info``)."""

    base_backend: str
    method: SparseMethod[Any]

    def _bind_method(self) -> None:
        self.method = get_runtime().method


class SparseTorchNativeBackend(_SparseBackendMixin, TorchNativeAttnBackend):
    base_backend = "torch_native"

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self._bind_method()


class SparseTritonBackend(_SparseBackendMixin, TritonAttnBackend):
    base_backend = "triton"

    def __init__(self, model_runner: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model_runner, *args, **kwargs)
        self._bind_method()


def create_backend(model_runner: Any) -> _SparseBackendMixin:
    """Factory for ``register_attention_backend``: picks the base by the runner's device."""
    if getattr(model_runner, "device", None) == "cpu":
        return SparseTorchNativeBackend(model_runner)
    if model_runner.model_config.is_encoder_decoder:
        raise ValueError("sgl_sparse: encoder-decoder models are not supported (no cross attention)")
    return SparseTritonBackend(model_runner)
