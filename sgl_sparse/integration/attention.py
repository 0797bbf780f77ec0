"""Our attention backend (registered as ``sgl_sparse``).

It is the seam where methods change which K/V attention reads. With ``dense`` it adds nothing to the
stock kernels it wraps, so output and speed equal vanilla SGLang. With an evicting method, rows of
``req_to_token`` hold sentinel slots (0) at evicted positions, which attention must skip:

* ``device == "cpu"``: :class:`SparseTorchNativeBackend` over SGLang's ``TorchNativeAttnBackend``;
  per request it gathers the live slots and masks by logical position (``kpos <= qpos``).
* otherwise: :class:`SparseTritonBackend` over SGLang's ``TritonAttnBackend``: every KV index list
  (decode, extend prefix, CUDA-graph buffers) is built by ``_fill_kv_indptr_and_indices``, which we
  replace with a compacting Triton kernel, so the stock kernels (and CUDA graphs) read only live slots.

Methods with an observation window (SnapKV) also get their requests' last post-RoPE queries here.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from torch.nn.functional import scaled_dot_product_attention

from sgl_sparse.integration import SENTINEL_SLOT
from sgl_sparse.integration.runtime import SparseRuntime, get_runtime


class _SparseBackendMixin:
    base_backend: str
    runtime: SparseRuntime

    def _bind_runtime(self) -> None:
        self.runtime = get_runtime()
        self.method = self.runtime.method
        self.skip_sentinels = self.method.evicts
        # Decided once: the per-layer hot path of dense requests does no method calls.
        self.capture_prefill = self.method.observation_window() > 0
        self.capture_decode = self.capture_prefill and self.method.observes_decode()

    def _capture(self, q: Any, layer: Any, forward_batch: Any, is_decode: bool) -> None:
        if not (self.capture_decode if is_decode else self.capture_prefill) or forward_batch.rids is None:
            return
        lens = [1] * len(forward_batch.rids) if is_decode else list(forward_batch.extend_seq_lens_cpu)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        self.runtime.capture_queries(layer.layer_id, q3, forward_batch.rids, lens, float(layer.scaling))


class SparseTorchNativeBackend(_SparseBackendMixin, TorchNativeAttnBackend):
    base_backend = "torch_native"

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self._bind_runtime()

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self._capture(q, layer, forward_batch, is_decode=False)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        self._capture(q, layer, forward_batch, is_decode=True)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,  # type: ignore[no-untyped-def]
                                 seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                                 enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
        if not self.skip_sentinels:
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        start_q = 0
        for i in range(seq_lens.shape[0]):
            n_kv, n_prefix, n_q = int(seq_lens[i]), int(extend_prefix_lens[i]), int(extend_seq_lens[i])
            q_pos = torch.arange(n_prefix, n_prefix + n_q, device=query.device)
            output[start_q:start_q + n_q] = self._attend_live(
                query[start_q:start_q + n_q], q_pos, k_cache, v_cache, req_to_token[req_pool_indices[i], :n_kv],
                scaling, enable_gqa, causal)
            start_q += n_q
        return output

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,  # type: ignore[no-untyped-def]
                                 seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                                 is_cross_attn=False, sliding_window_size=None):
        if not self.skip_sentinels:
            return super()._run_sdpa_forward_decode(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens, scaling,
                enable_gqa, causal, is_cross_attn, sliding_window_size)
        for i in range(seq_lens.shape[0]):
            n_kv = int(seq_lens[i])
            q_pos = torch.tensor([n_kv - 1], device=query.device)
            output[i:i + 1] = self._attend_live(query[i:i + 1], q_pos, k_cache, v_cache,
                                                req_to_token[req_pool_indices[i], :n_kv], scaling, enable_gqa, True)
        return output

    @staticmethod
    def _attend_live(q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     row: torch.Tensor, scaling: float | None, enable_gqa: bool, causal: bool) -> torch.Tensor:
        """q ``[n_q, H, D]`` over the live slots of ``row``, causal by logical position."""
        live = (row != SENTINEL_SLOT).nonzero().flatten()
        slots = row[live].long()
        k = k_cache[slots].movedim(0, 1)  # [Hkv, n, D]
        v = v_cache[slots].movedim(0, 1)
        qh = q.movedim(0, 1)  # [H, n_q, D]
        if k.dtype != qh.dtype:
            k, v = k.to(qh.dtype), v.to(qh.dtype)
        mask = (live[None, :] <= q_pos[:, None]) if causal else None
        out = scaled_dot_product_attention(qh.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           scale=scaling, enable_gqa=enable_gqa)
        return out.squeeze(0).movedim(1, 0)


class SparseTritonBackend(_SparseBackendMixin, TritonAttnBackend):
    base_backend = "triton"

    def __init__(self, model_runner: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model_runner, *args, **kwargs)
        self._bind_runtime()

    def _fill_kv_indptr_and_indices(self, bs: int, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                                    kv_indices: torch.Tensor) -> torch.Tensor:
        if not self.skip_sentinels:
            return super()._fill_kv_indptr_and_indices(bs, seq_lens, req_pool_indices, kv_indices)
        from sgl_sparse.kernels.compact import fill_compact_kv_indices

        return fill_compact_kv_indices(self.req_to_token, req_pool_indices[:bs], seq_lens[:bs], self.kv_indptr,
                                       kv_indices)

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._capture(q, layer, forward_batch, is_decode=False)
        return super().forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._capture(q, layer, forward_batch, is_decode=True)
        return super().forward_decode(q, k, v, layer, forward_batch, *args, **kwargs)


IMPL_ENV = "SGLSPARSE_ATTENTION_IMPL"  # auto (default) | torch | triton


def create_backend(model_runner: Any) -> _SparseBackendMixin:
    """Factory for ``register_attention_backend``: picks the base by the runner's device, unless
    ``SGLSPARSE_ATTENTION_IMPL`` says otherwise (``triton`` on CPU runs the GPU path under
    ``TRITON_INTERPRET=1``, which is how CI tests it)."""
    impl = os.environ.get(IMPL_ENV, "auto")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"{IMPL_ENV}={impl!r}: expected auto, torch or triton")
    on_cpu = getattr(model_runner, "device", None) == "cpu"
    if impl == "torch" or (impl == "auto" and on_cpu):
        return SparseTorchNativeBackend(model_runner)
    if model_runner.model_config.is_encoder_decoder:
        raise ValueError("sgl_sparse: encoder-decoder models are not supported (no cross attention)")
    return SparseTritonBackend(model_runner)
