"""Our attention backends (registered as ``sgl_sparse``; :func:`.backends.create_backend` picks one).

It is the seam where methods change which K/V attention reads. With ``dense`` it adds nothing to the
stock kernels it wraps, so output and speed equal vanilla SGLang. With an evicting method, rows of
``req_to_token`` hold sentinel slots (0) at evicted positions, which attention must skip. The base it
wraps (the launcher's choice, ``handoff.base``):

* ``flashinfer`` (CUDA default): :class:`~.flashinfer_backend.SparseFlashInferBackend` over SGLang's
  ``FlashInferAttnBackend``, in its own module (imported only for that base): every FlashInfer KV list is
  built by a module-global Triton kernel, which our compacting launcher stands in for while our backend
  builds its metadata, so the lists hold live slots only.
* ``triton``: :class:`SparseTritonBackend` over SGLang's ``TritonAttnBackend``: its lists are built
  by ``_fill_kv_indptr_and_indices``, which we replace with the same compacting kernel.
* ``torch_native`` (CPU): :class:`SparseTorchNativeBackend`; per request it gathers the live slots
  and masks by logical position (``kpos <= qpos``).

What every base shares is :class:`SparseBackendMixin`, with the plain-torch parts of a method-owned layout's
attention (the CPU path); the FlashInfer class replaces them with FlashInfer's (the GPU path).

Decode lists give a row with no live slot one padding slot (``min_one``): only CUDA-graph padding rows
have none, and the kernels expect one slot there; their lengths come from the live counts of the
runtime's device table (``integration/tables.py``), the ones the host-side plan uses. Extend prefix
lists may be empty (a fully evicted prefix attends nothing, on every base). Methods with an
observation window (SnapKV) also get their requests' last post-RoPE queries here.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from torch.nn.functional import scaled_dot_product_attention

from sgl_sparse.errors import SparseConfigError
from sgl_sparse.integration.capture import ring_shape
from sgl_sparse.integration.runtime import SparseRuntime, get_runtime
from sgl_sparse.integration.selection import allocate_once, attend_itself, attend_selected, observe, write_summaries
from sgl_sparse.integration.store_attention import (
    ExtendLists,
    StoreRows,
    causal_attention_torch,
    decode_rows,
    extend_lists,
    merge,
    open_pages_attention_torch,
    prefix_attention_torch,
    store_decode,
    store_extend,
)
from sgl_sparse.integration.syncs import no_host_sync
from sgl_sparse.kernels.pages import selected_positions_mask
from sgl_sparse.slots import SENTINEL_SLOT

BASES = ("flashinfer", "triton", "torch_native")


class SparseBackendMixin:
    base_backend: str
    runtime: SparseRuntime
    # Set by the SGLang base's constructor.
    req_to_token_pool: Any
    token_to_kv_pool: Any
    # Whether the lists being built serve a decode step (one padding slot for an empty row) or an
    # extend step (empty stays empty); set around each metadata build.
    decode_lists: bool = False
    # The replay whose forward runs now (integration/replay.py hands it over for that forward): its layers go to
    # its scorer, and its queries are no window queries; None otherwise.
    replay: Any = None

    def _bind_runtime(self, model_runner: Any) -> None:
        self.runtime = get_runtime()
        self.method = self.runtime.method
        self.skip_sentinels = self.runtime.evicting  # the server's method or one a request may choose evicts
        self.selector = self.method.selector
        if self.selector is not None:
            allocate_once(self.selector, model_runner)
        self.store = self.method.store
        if self.store is not None:
            self.store.attach_rows(model_runner.req_to_token_pool.req_to_token)
        self.store_lists: ExtendLists | None = None  # the extend step's prefix lists (method-owned layouts)
        if self.store is not None and model_runner.device != "cpu" and not self.dense_prefix_on_gpu:
            try:
                self.store.decline_dequantized_prefix("on a GPU it reads the prefix through FlashInfer's prefill, "
                                                      "so it needs --attention-backend flashinfer")
            except SparseConfigError as e:
                raise ValueError(f"sgl_sparse: {self.method.name}'s {e}") from None
        self.dequantize_prefix = self.store is not None and self.store.dequantize_prefix
        # A decode step's compacted rows, when a store serves under eviction (built once per forward).
        self.store_rows: StoreRows | None = None
        if self.store is not None and not hasattr(model_runner.token_to_kv_pool, "store"):
            raise RuntimeError(f"sgl_sparse: {self.method.name} owns the KV layout but the pool was built by "
                               "SGLang (the plug-in's pool hook did not run)")
        # Decided once: the per-layer hot path of dense requests does no method calls.
        self.capture_prefill = self.runtime.observes
        self.capture_decode = self.runtime.decode_window > 0
        if self.capture_decode:
            rows = int(model_runner.req_to_token_pool.req_to_token.shape[0])
            shape = ring_shape(model_runner.model_config, rows, self.runtime.decode_window)
            self.runtime.capture.allocate_ring(shape, torch.device(model_runner.device))

    def init_forward_metadata(self, forward_batch: Any) -> None:
        self.decode_lists = forward_batch.forward_mode.is_decode_or_idle()
        super().init_forward_metadata(forward_batch)  # type: ignore[misc]
        if self.store is None:
            return
        req_to_token = self.req_to_token_pool.req_to_token
        if forward_batch.forward_mode.is_extend():
            lists = self.store_lists = extend_lists(forward_batch, req_to_token, compact=self.skip_sentinels,
                                                    dequantize=self.dequantize_prefix, group=self.store.encoding_group)
            if self.dequantize_prefix and lists.has_prefix:
                c = self.runtime.counters
                if lists.dense is not None:
                    c.prefix_dequantized_steps_total += 1
                else:
                    c.prefix_kernel_steps_total += 1
        elif self.skip_sentinels and forward_batch.forward_mode.is_decode() and not req_to_token.is_cuda:
            # CPU: compacted rows built per step (a sort over each row); CUDA reads the base's compacted lists
            # (_store_decode_rows), which CUDA graphs replay.
            self.store_rows = decode_rows(forward_batch, req_to_token, compact=True)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        self.decode_lists = forward_batch.forward_mode.is_decode_or_idle()
        super().init_forward_metadata_out_graph(forward_batch, in_capture)  # type: ignore[misc]

    def _fill_lists(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> torch.Tensor:
        """Compacted lists of these rows (every base's list builder calls this): decode lists take
        their lengths from the runtime's live counts (one padding slot for an empty row), extend lists
        count them."""
        from sgl_sparse.kernels.compact import fill_compact_kv_indices

        tables = self.runtime.tables
        with no_host_sync(self.decode_lists):
            counts = tables.decode_counts(req_pool_indices) if self.decode_lists else None
            return fill_compact_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
                                           min_one=self.decode_lists, counts=counts, mismatches=tables.mismatches)

    # Every base: capture the window queries, then the stock attention (each base's own signature);
    # a selecting layer's K also goes into the selector's page metadata, and its decode reads a selection.
    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.store is not None:
            self._capture(q, layer, forward_batch, is_decode=False)
            return store_extend(self, q, k, v, layer, forward_batch, self.store_lists,
                                kwargs.get("save_kv_cache", args[0] if args else True), self._new_tokens_attention,
                                self._merge_parts, self._dense_prefix_attention, self._open_pages_attention)
        self._capture(q, layer, forward_batch, is_decode=False)
        out = super().forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)  # type: ignore[misc]
        if self.selector is not None:
            write_summaries(self.selector, layer, forward_batch.out_cache_loc, k)
        if self.replay is not None:
            self.replay.on_layer(layer, q, k)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.store is not None:
            self._capture(q, layer, forward_batch, is_decode=True)
            rows = self._store_decode_rows(forward_batch, q)
            return store_decode(self, q, k, v, layer, forward_batch, rows,
                                kwargs.get("save_kv_cache", args[0] if args else True))
        self._capture(q, layer, forward_batch, is_decode=True)
        if self.selector is not None and self.selector.selects(layer.layer_id) and not layer.is_cross_attention:
            write_summaries(self.selector, layer, forward_batch.out_cache_loc, k, decode=True)
            return self._forward_decode_selected(q, k, v, layer, forward_batch, *args, **kwargs)
        out = super().forward_decode(q, k, v, layer, forward_batch, *args, **kwargs)  # type: ignore[misc]
        if self.selector is not None and self.selector.observes(layer.layer_id) and not layer.is_cross_attention:
            observe(self.selector, layer, q, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                    self.req_to_token_pool.req_to_token, forward_batch)
        return out

    def _forward_decode_selected(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        """A selecting layer's decode: this step's K/V written, then the selector's own attention (``attends``) or
        the base's read of the selected pages."""
        if not self.serves_selection:
            raise NotImplementedError(f"sgl_sparse: {self.method.name} has no decode path on the {self.base_backend} "
                                      "base")
        if save_kv_cache and k is not None and v is not None:
            self._write_selected_kv(layer, forward_batch, k, v)
        if self.selector.attends:
            q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
            k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
            o = attend_itself(self.selector, layer, q3, k_buf, v_buf, self.req_to_token_pool.req_to_token,
                              forward_batch)
            return o.reshape(q3.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        return self._attend_selection(layer, q, forward_batch)

    # A base that serves selection says so and gives how a selecting layer writes this step's K/V and how it
    # reads the selected pages (``[tokens, Hq * Dv]``).
    serves_selection = False

    def _write_selected_kv(self, layer: Any, forward_batch: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def _attend_selection(self, layer: Any, q: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def _new_tokens_attention(self, q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor, layer: Any,
                              lists: ExtendLists) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend step's new tokens over themselves (causal, full precision): (output, natural lse)."""
        return causal_attention_torch(q3, k3, v3, lists.extend_lens, float(layer.scaling))

    def _store_decode_rows(self, forward_batch: Any, q: torch.Tensor) -> StoreRows:
        """The rows a store's decode reads: each request's own, or under eviction its live slots (built per step
        on CPU)."""
        if self.skip_sentinels:
            assert self.store_rows is not None, "compacted store rows are built per step on CPU only"
            return self.store_rows
        return decode_rows(forward_batch, self.req_to_token_pool.req_to_token)

    # Whether this base has a GPU dense prefill for a store's dequantized prefix (FlashInfer's); on CPU every base
    # attends it in plain torch.
    dense_prefix_on_gpu = False

    def _dense_prefix_attention(self, q3: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                                lists: ExtendLists) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend step's queries over their whole prefix, dequantized (``lists.dense``): (output, natural lse)."""
        assert lists.dense is not None
        return prefix_attention_torch(q3, k, v, lists.extend_lens, lists.dense.lens, float(layer.scaling))

    def _open_pages_attention(self, q3: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, layer: Any,
                              lists: ExtendLists) -> tuple[torch.Tensor, torch.Tensor]:
        """A grouped store's new tokens over their open pages (``lists.open``, buffers ``kb``/``vb`` of
        ``store_attention.open_page_kv``): (output, natural lse)."""
        assert lists.open is not None
        return open_pages_attention_torch(q3, kb, vb, lists.open, lists.extend_lens, float(layer.scaling))

    @staticmethod
    def _merge_parts(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
        return merge(o1, lse1, o2, lse2)

    def _capture(self, q: Any, layer: Any, forward_batch: Any, is_decode: bool) -> None:
        if not (self.capture_decode if is_decode else self.capture_prefill):
            return
        if self.replay is not None:
            # A replay forward (KVzip's reconstruction) carries the request's rid, but its queries are not the
            # request's: the method's window (SnapKV's, after a kvzip_global prune) is the prompt's last queries.
            return
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        capture = self.runtime.capture
        if is_decode:
            # By row and position, from the batch's device tensors: a replayed decode CUDA graph has no rids.
            capture.write_decode(layer.layer_id, q3, forward_batch.req_pool_indices, forward_batch.positions,
                                 float(layer.scaling))
            return
        if forward_batch.rids is None:
            return
        capture.record(layer.layer_id, q3, forward_batch.rids, list(forward_batch.extend_seq_lens_cpu),
                       float(layer.scaling), forward_batch.positions)


class SparseTorchNativeBackend(SparseBackendMixin, TorchNativeAttnBackend):
    base_backend = "torch_native"
    serves_selection = True

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self._bind_runtime(model_runner)
        self._extend_layer: Any = None

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._extend_layer = layer  # whose static selection (PyramidKV's layer sets) the extend reads
        return super().forward_extend(q, k, v, layer, forward_batch, *args, **kwargs)

    def _static_selection(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          seq_lens: torch.Tensor) -> torch.Tensor | None:
        """``[bs, Hkv, width]``: what this layer's static selection lets an extend read, else ``None`` (all)."""
        sel, layer = self.selector, self._extend_layer
        if sel is None or not sel.static or layer is None or not sel.selects(layer.layer_id):
            return None
        # A static selection is read without queries (PyramidKV's layer sets); the contract types q as a Tensor.
        pages = sel.select(layer.layer_id, None, req_to_token, req_pool_indices, seq_lens)  # type: ignore[arg-type]
        return selected_positions_mask(pages, seq_lens, layer.tp_k_head_num, sel.page_size, int(seq_lens.max()))

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,  # type: ignore[no-untyped-def]
                                 seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                                 enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None):
        if not self.skip_sentinels:
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        visible = self._static_selection(req_to_token, req_pool_indices, seq_lens)
        start_q = 0
        for i in range(seq_lens.shape[0]):
            n_kv, n_prefix, n_q = int(seq_lens[i]), int(extend_prefix_lens[i]), int(extend_seq_lens[i])
            q_pos = torch.arange(n_prefix, n_prefix + n_q, device=query.device)
            output[start_q:start_q + n_q] = self._attend_live(
                query[start_q:start_q + n_q], q_pos, k_cache, v_cache, req_to_token[req_pool_indices[i], :n_kv],
                scaling, enable_gqa, causal, None if visible is None else visible[i, :, :n_kv])
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

    def _write_selected_kv(self, layer: Any, forward_batch: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                            k, v)

    def _attend_selection(self, layer: Any, q: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        assert self.selector is not None
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        o = attend_selected(self.selector, layer, q3, k_buf, v_buf, self.req_to_token_pool.req_to_token,
                            forward_batch.req_pool_indices, forward_batch.seq_lens)
        return o.reshape(q3.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    @staticmethod
    def _attend_live(q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     row: torch.Tensor, scaling: float | None, enable_gqa: bool, causal: bool,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[n_q, H, D]`` over the live slots of ``row``, causal by logical position; ``visible``
        (``[Hkv, n]`` over the row's positions): only those, per KV head (a static selection)."""
        live = (row != SENTINEL_SLOT).nonzero().flatten()
        slots = row[live].long()
        k = k_cache[slots].movedim(0, 1)  # [Hkv, n, D]
        v = v_cache[slots].movedim(0, 1)
        qh = q.movedim(0, 1)  # [H, n_q, D]
        if k.dtype != qh.dtype:
            k, v = k.to(qh.dtype), v.to(qh.dtype)
        mask = (live[None, :] <= q_pos[:, None]) if causal else None
        if visible is not None:  # [H, n_q, n_live]: the KV head's selection, for each of its query heads
            per_head = visible[:, live].repeat_interleave(qh.shape[0] // visible.shape[0], dim=0)[:, None, :]
            mask = per_head if mask is None else per_head & mask[None]
        out = scaled_dot_product_attention(qh.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           scale=scaling, enable_gqa=enable_gqa)
        return out.squeeze(0).movedim(1, 0)


class SparseTritonBackend(SparseBackendMixin, TritonAttnBackend):
    base_backend = "triton"

    def __init__(self, model_runner: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model_runner, *args, **kwargs)
        self._bind_runtime(model_runner)

    def _fill_kv_indptr_and_indices(self, bs: int, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                                    kv_indices: torch.Tensor) -> torch.Tensor:
        if not self.skip_sentinels:
            return super()._fill_kv_indptr_and_indices(bs, seq_lens, req_pool_indices, kv_indices)
        return self._fill_lists(self.req_to_token, req_pool_indices[:bs], seq_lens[:bs], self.kv_indptr, kv_indices)
