"""Our backend over SGLang's ``FlashInferAttnBackend`` (the CUDA default base; see :mod:`.attention`).

Imported only when that base is chosen (FlashInfer runs on CUDA only), so everything here runs on the GPU:
the plain-torch paths of the CPU base stay in :class:`~.attention.SparseBackendMixin`.

Every FlashInfer KV list (eager and CUDA-graph decode, extend with a paged prefix beside the ragged new tokens,
paged-only extend) is built by the module-global Triton kernel ``create_flashinfer_kv_indices_triton``; while
our backend builds its metadata that name is bound to our compacting launcher, so the lists hold live slots only.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from sglang.srt.layers.attention import flashinfer_backend as fib
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

from sgl_sparse.integration.attention import SparseBackendMixin
from sgl_sparse.integration.store_attention import LN2, ExtendLists, StoreRows, flat_rows
from sgl_sparse.integration.syncs import no_host_sync


class CompactingIndexLauncher:
    """Stands in for ``flashinfer_backend.create_flashinfer_kv_indices_triton`` (called as
    ``kernel[grid](...)``): while one of our backends builds its lists and the method evicts, it writes
    compacted lists (``kv_indptr`` rewritten in place, the view the stock code passes); otherwise, or
    for lists with a start offset (sliding window, cross attention), it runs the stock kernel."""

    def __init__(self, stock: Any) -> None:
        self.stock = stock
        self.active: SparseBackendMixin | None = None

    def __getitem__(self, grid: Any) -> Any:
        def launch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor,
                   kv_indptr: torch.Tensor, kv_start_idx: Any, kv_indices: torch.Tensor, stride: int) -> None:
            backend = self.active
            if backend is None or kv_start_idx is not None:
                self.stock[grid](req_to_token, req_pool_indices, lens, kv_indptr, kv_start_idx, kv_indices, stride)
                return
            bs = int(grid[0])
            backend._fill_lists(req_to_token, req_pool_indices[:bs], lens[:bs], kv_indptr, kv_indices)

        return launch


def install_launcher() -> CompactingIndexLauncher:
    """Install (once per process) our launcher under the FlashInfer backend module's kernel name."""
    current = fib.create_flashinfer_kv_indices_triton
    if not isinstance(current, CompactingIndexLauncher):
        current = CompactingIndexLauncher(current)
        fib.create_flashinfer_kv_indices_triton = current
    return current


class SparseFlashInferBackend(SparseBackendMixin, FlashInferAttnBackend):
    """Eager decode and extend plan from the device ``kv_indptr`` (FlashInfer copies it to the host, as stock
    SGLang already pays); graph decode plans from host lengths, which we give exactly from the runtime's
    counters (:meth:`_with_live_lens`). A method-owned layout's extend reads its new tokens through FlashInfer's
    ragged prefill and its dequantized prefix and open pages through FlashInfer prefill wrappers."""

    base_backend = "flashinfer"
    dense_prefix_on_gpu = True
    serves_selection = True

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner, init_new_workspace=model_runner.init_new_workspace)
        # The stock constructor checks KV-cache access only for its own class, not subclasses.
        self._check_kv_attention_access("prefill", self.prefill_kv_access)
        self._check_kv_attention_access("decode", self.decode_kv_access)
        self._bind_runtime(model_runner)
        deterministic = getattr(model_runner.server_args, "enable_deterministic_inference", False)
        if self.store is not None and (self.is_multimodal or getattr(self, "use_paged", False) or deterministic):
            raise ValueError(f"sgl_sparse: {self.method.name}'s extend reads new tokens through FlashInfer's "
                             "ragged prefill, which SGLang turns off for multimodal models, deterministic "
                             "inference and SGLANG_FLASHINFER_USE_PAGED")
        if self.skip_sentinels and (self.use_sliding_window_kv_pool or self.enable_mis):
            raise ValueError("sgl_sparse: sliding-window pools and multi-item scoring are not supported with "
                             "eviction (they address KV by logical position)")
        self.launcher = install_launcher() if self.skip_sentinels else None
        self.selection = None
        if self.selector is not None and not self.selector.attends:
            from sgl_sparse.integration.flashinfer_selection import FlashInferSelection

            self.selection = FlashInferSelection(self, self.selector)
        self._dense_wrapper: Any = None
        self._dense_planned: ExtendLists | None = None  # the lists the wrapper is planned for (one plan a forward)
        self._pages_wrapper: Any = None
        self._pages_planned: ExtendLists | None = None  # the lists the paged wrapper is planned for

    # Metadata: our launcher builds the lists while the stock code plans them.

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args: Any, **kwargs: Any) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        if self.selection is not None:
            self.selection.init_graph_state(max_num_tokens, self.workspace_buffer.device)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        if self.launcher is None:
            super().init_forward_metadata(forward_batch)
        else:
            self.launcher.active = self
            try:
                super().init_forward_metadata(forward_batch)
            finally:
                self.launcher.active = None
        if self.selection is not None and forward_batch.forward_mode.is_decode_or_idle():
            self.selection.plan_eager(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        if self.launcher is None:
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
        else:
            fb = forward_batch
            if fb.forward_mode.is_decode_or_idle() and not in_capture:
                fb = self._with_live_lens(fb)
            self.launcher.active = self
            try:
                super().init_forward_metadata_out_graph(fb, in_capture)
            finally:
                self.launcher.active = None
        if self.selection is not None and forward_batch.forward_mode.is_decode_or_idle():
            with no_host_sync(not in_capture and forward_batch.seq_lens_cpu is not None):
                self.selection.plan_graph(forward_batch, in_capture)

    def _with_live_lens(self, fb: Any) -> Any:
        """Graph decode plans on the host from ``seq_lens_cpu`` (logical lengths). Give it the live
        lengths instead: from the runtime's host counters when it has them for this batch (no sync),
        else ``None``, which makes FlashInfer read the compacted indptr from the device (one sync).
        Padding rows keep the fill length 1: their list has exactly one slot (``min_one``)."""
        if fb.seq_lens_cpu is None:
            return fb
        fb = copy.copy(fb)
        live = self.runtime.decode_live_lens
        raw_bs = fb.batch_size - int(getattr(fb, "num_padding", 0) or 0)
        if live is None or live.numel() != raw_bs:
            fb.seq_lens_cpu = None
            return fb
        lens = fb.seq_lens_cpu.clone()
        lens[:raw_bs] = live.to(lens.dtype)
        fb.seq_lens_cpu = lens
        return fb

    # A selecting layer's decode (SparseBackendMixin._forward_decode_selected).

    def _write_selected_kv(self, layer: Any, forward_batch: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.forward_metadata.swa_out_cache_loc), k, v,
            *self._kv_write_scales(layer))

    def _attend_selection(self, layer: Any, q: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        assert self.selection is not None
        return self.selection.attend(layer, q, self.token_to_kv_pool.get_kv_buffer(layer.layer_id),
                                     self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                     forward_batch.seq_lens)

    # A method-owned layout's parts (store_attention.store_extend / store_decode), through FlashInfer.

    def _new_tokens_attention(self, q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, layer: Any,
                              lists: ExtendLists) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.forward_metadata.use_ragged:
            raise RuntimeError(f"sgl_sparse: {self.method.name} reads an extend's new tokens through "
                               "FlashInfer's ragged prefill, which this step did not plan (deterministic "
                               "inference or a piecewise prefill graph)")
        o, lse2 = self.prefill_wrapper_ragged.forward_return_lse(q3, k3, v3, causal=True, sm_scale=layer.scaling)
        return o, lse2 * LN2  # FlashInfer's log-sum-exp is base 2

    def _store_decode_rows(self, forward_batch: Any, q: torch.Tensor) -> StoreRows:
        if not self.skip_sentinels:
            return super()._store_decode_rows(forward_batch, q)
        # A composition: the decode wrapper's lists, compacted by our index launcher from the runtime's live
        # counts (device only), in the graph's static buffers under CUDA graphs; the store reads them as rows
        # (flat_rows) instead of req_to_token's, which hold sentinels.
        w = self.forward_metadata.decode_wrappers[0]
        return flat_rows(w._paged_kv_indptr_buf, w._paged_kv_indices_buf, q.shape[0],
                         self.req_to_token_pool.req_to_token.shape[1])

    def _open_pages_attention(self, q3: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, layer: Any,
                              lists: ExtendLists) -> tuple[torch.Tensor, torch.Tensor]:
        pages = lists.open
        assert pages is not None
        if self._pages_planned is not lists:
            from flashinfer import BatchPrefillWithPagedKVCacheWrapper

            if self._pages_wrapper is None:  # SGLang's float workspace, as its own wrappers share it
                self._pages_wrapper = BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, "NHD")
            # One request per page of queries; host indptrs and indices: the plan copies them without a sync.
            self._pages_wrapper.plan(pages.qo_indptr, pages.kv_indptr, pages.kv_indices, pages.last_page_len,
                                     q3.shape[1], kb.shape[1], q3.shape[2], pages.group, causal=True,
                                     q_data_type=q3.dtype, kv_data_type=kb.dtype)
            self._pages_planned = lists
        # The buffer's pages as stored, then at full precision (OpenPages.kv_indices counts them so).
        shape = (2 * pages.pages, pages.group, *kb.shape[1:])
        o, lse = self._pages_wrapper.forward_return_lse(q3, (kb.view(shape), vb.view(shape)), causal=True,
                                                        sm_scale=layer.scaling)
        return o, lse * LN2  # FlashInfer's log-sum-exp is base 2

    def _dense_prefix_attention(self, q3: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                                lists: ExtendLists) -> tuple[torch.Tensor, torch.Tensor]:
        dense = lists.dense
        assert dense is not None
        if self._dense_planned is not lists:
            from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

            if self._dense_wrapper is None:  # SGLang's float workspace, as its own wrappers share it
                self._dense_wrapper = BatchPrefillWithRaggedKVCacheWrapper(self.workspace_buffer, "NHD")
            # Host indptrs over the requests with a prefix: the plan copies them to the device without a sync.
            self._dense_wrapper.plan(dense.qo_indptr, dense.kv_indptr, q3.shape[1], k.shape[1], q3.shape[2],
                                     causal=False, q_data_type=q3.dtype, kv_data_type=k.dtype)
            self._dense_planned = lists
        rows = dense.q_rows
        qs = q3 if rows is None else q3.index_select(0, rows)
        o, lse = self._dense_wrapper.forward_return_lse(qs, k, v, causal=False, sm_scale=layer.scaling)
        lse = lse * LN2  # FlashInfer's log-sum-exp is base 2
        if rows is None:
            return o, lse
        # Requests without a prefix: an empty part (output 0, log-sum-exp -inf), which the merge weighs 0.
        full_o = o.new_zeros((q3.shape[0], *o.shape[1:]))
        full_lse = lse.new_full((q3.shape[0], lse.shape[1]), float("-inf"))
        full_o[rows], full_lse[rows] = o, lse
        return full_o, full_lse

    @staticmethod
    def _merge_parts(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
        # FlashInfer's merge (bf16 in and out, base-2 lse): no fp32 copies of a 16K-token chunk per layer.
        from flashinfer.cascade import merge_state

        return merge_state(o1, lse1 / LN2, o2, lse2 / LN2)[0]
