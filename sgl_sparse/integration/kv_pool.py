"""The KV pool of a method that owns its layout (:class:`sgl_sparse.contract.KVStore`), and the pool's size.

SGLang 0.5.17 has no registry of MHA pools; two AROUND hooks are the narrowest seam
(../shared/notes/sglang-0.5.17-wave2-map.md §B.2):

* ``DefaultPoolConfigurator._compute_cell_size`` (bytes per token, all layers): for a store, its
  :meth:`~sgl_sparse.contract.KVStore.bytes_per_token` replaces SGLang's bf16 cell, so the planner's
  ``max_total_num_tokens = available // cell`` gives more tokens for fewer bytes; for a selector, its
  metadata bytes are added (the pool shrinks by what the metadata then takes).
* ``KVCacheConfigurator._build_mha_kv_pool``: for a store, :class:`SparseStorePool` (a subclass of
  SGLang's ``MHATokenToKVPool``) instead of the stock pool, same arguments.
* A store whose layout derives from the model (``needs_model``, Palu's bases) gets the loaded model's K/V
  projections and rotary table (``integration/model_kv.py``) just before its pool is built.
* A store's fixed bytes (per-request buffers, e.g. KIVI's residual) and the decode query ring of methods that
  observe decode (integration/capture.py) come out of the budget in an AFTER hook on
  ``KVCacheConfigurator._profile_available_bytes``, accounted for ``--max-running-requests`` + 1 request rows;
  the rows SGLang then builds are noted around ``_build_token_to_kv_pool``.

The pool keeps SGLang's interface: its ``k_buffer``/``v_buffer`` lists are the store's code tensors (so
slot pointers, sizes and the allocator work unchanged), K/V is written only by our attention backend,
through :meth:`~sgl_sparse.contract.KVStore.write` with each token's row (``set_kv_buffer`` raises), and a
slot move copies all the store's per-slot tensors. Nothing reads the codes as K/V: our attention backend
reads through the store (``integration/attention.py``); ``get_key_buffer`` returns the raw codes for
SGLang's shape probes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sgl_sparse.contract import KVGeometry, KVStore, PageSelector
from sgl_sparse.integration import handoff
from sgl_sparse.integration.capture import ring_shape

logger = logging.getLogger(__name__)


def _served_method() -> Any:
    """The method this server was launched with (``None`` in a vanilla or dense server)."""
    if handoff.read().method in (None, "dense"):
        return None
    from sgl_sparse.integration.runtime import get_runtime

    return get_runtime().method


def _served_store() -> KVStore | None:
    method = _served_method()
    return None if method is None else method.store


def _served_selector() -> PageSelector | None:
    method = _served_method()
    return None if method is None else method.selector


def _sizing_geometry(kvc: Any, num_layers: int) -> KVGeometry:
    from sglang.srt.runtime_context import get_parallel

    tp = get_parallel().attn_tp_size
    mc = kvc.model_config
    return KVGeometry(num_layers=num_layers, num_q_heads=mc.num_attention_heads // tp,
                      num_kv_heads=mc.get_num_kv_heads(tp), head_dim=mc.head_dim, page_size=kvc.page_size,
                      num_slots=0, dtype=kvc.kv_cache_dtype, device=torch.device(kvc.device))


def around_cell_size(original: Any, configurator: Any, kvc: Any, num_layers: int) -> int:
    """AROUND ``DefaultPoolConfigurator._compute_cell_size``: a store's bytes per token instead of
    SGLang's; a selector's metadata per token beside SGLang's."""
    cell = original(configurator, kvc, num_layers)
    store, selector = _served_store(), _served_selector()
    if store is not None and (getattr(kvc, "use_mla_backend", False) or getattr(kvc, "is_hybrid_swa", False)
                              or getattr(kvc, "mambaish_config", None) is not None):
        raise ValueError(f"sgl_sparse: {type(store).__name__} replaces SGLang's MHA pool; MLA, hybrid SWA and "
                         "hybrid SSM models build other pools")
    if store is not None:
        own = store.bytes_per_token(_sizing_geometry(kvc, num_layers))
        logger.info("sgl_sparse: KV cell %d bytes per token in %s's layout (SGLang's %s: %d)", own,
                    type(store).__name__, kvc.kv_cache_dtype, cell)
        return own
    if selector is not None:
        extra = selector.metadata_bytes_per_token(_sizing_geometry(kvc, num_layers))
        logger.info("sgl_sparse: KV cell %d bytes per token + %d of selection metadata", cell, extra)
        return cell + extra
    return cell


def _accounted_requests(configurator: Any) -> int:
    """The request rows a store's per-request buffers are accounted for: SGLang's ``req_to_token`` has
    ``--max-running-requests`` + 1 rows (the launcher sets the flag for stores that need it)."""
    return int(configurator.server_args.max_running_requests or 0) + 1


def _ring_bytes(configurator: Any, rows: int) -> int:
    """The decode query ring's bytes (integration/capture.py) for ``rows`` request rows; 0 where no request
    observes decode."""
    h = handoff.read()
    if h.method in (None, "dense") and h.request_methods == "off":
        return 0  # nothing observes (a vanilla server loads the plug-in too: no runtime is built for it)
    from sgl_sparse.integration.runtime import get_runtime

    width = get_runtime().decode_window
    return ring_shape(configurator.model_config, rows, width).bytes if width else 0


def after_profile_available_bytes(result: int, configurator: Any, *args: Any, **kwargs: Any) -> int:
    """AFTER ``KVCacheConfigurator._profile_available_bytes``: per-request buffers (a store's or a selector's
    fixed bytes, the decode query ring) come out of the KV budget before SGLang divides it by the cell size."""
    rows = _accounted_requests(configurator)
    ring = _ring_bytes(configurator, rows)
    if ring:
        logger.info("sgl_sparse: %.1f MiB of decode query ring (%d request rows) taken from the KV budget",
                    ring / 2**20, rows)
    store, selector = _served_store(), _served_selector()
    if store is None and selector is None:
        return result - ring
    g = _sizing_geometry(configurator, configurator.model_config.num_hidden_layers)
    g = KVGeometry(**{**vars(g), "max_requests": rows})
    fixed = 0
    for owner in (store, selector):
        own = owner.fixed_bytes(g) if owner is not None else 0
        if own:
            logger.info("sgl_sparse: %.1f MiB of %s's per-request buffers (%d request rows) taken from the KV "
                        "budget", own / 2**20, type(owner).__name__, g.max_requests)
        fixed += own
    return result - fixed - ring


_REQUEST_ROWS: list[int] = []


def around_build_token_to_kv_pool(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``KVCacheConfigurator._build_token_to_kv_pool``: note the request rows SGLang built (its
    ``req_to_token_pool``), which the store's per-request buffers are indexed by."""
    pool = kwargs.get("req_to_token_pool")
    if pool is not None:
        _REQUEST_ROWS[:] = [int(pool.req_to_token.shape[0])]
    return original(configurator, *args, **kwargs)


def around_build_mha_kv_pool(original: Any, configurator: Any, *, max_total_num_tokens: int, mha_pool_class: type,
                             quant_method: Any = None) -> Any:
    """AROUND ``KVCacheConfigurator._build_mha_kv_pool``: the store's pool for a method that has one."""
    store = _served_store()
    if store is None:
        return original(configurator, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class,
                        quant_method=quant_method)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_exec, get_parallel

    if mha_pool_class is not MHATokenToKVPool or quant_method is not None:
        raise ValueError(f"sgl_sparse: {type(store).__name__} replaces SGLang's MHA pool, not "
                         f"{getattr(mha_pool_class, '__name__', mha_pool_class)}"
                         f"{' with a KV quant method' if quant_method is not None else ''}")
    mc = configurator.model_config
    tp = get_parallel().attn_tp_size
    rows = _REQUEST_ROWS[0] if _REQUEST_ROWS else 0
    g = _sizing_geometry(configurator, configurator.layer_info.num_effective_layers)
    accounted = _accounted_requests(configurator)
    if store.fixed_bytes(KVGeometry(**{**vars(g), "max_requests": rows})) > store.fixed_bytes(
            KVGeometry(**{**vars(g), "max_requests": accounted})):
        raise ValueError(f"sgl_sparse: SGLang built {rows} request rows, more than the {accounted} that "
                         f"{type(store).__name__}'s per-request buffers were accounted for (--max-running-requests)")
    if configurator.post_capture_kv_active:
        raise ValueError(f"sgl_sparse: {type(store).__name__} does not support post-capture KV sizing "
                         "(SGLANG_ENABLE_POST_CAPTURE_KV_SIZING)")
    if store.needs_model:
        from sgl_sparse.integration.model_kv import model_kv

        info = configurator.layer_info
        whole = tp == 1 and info.start_layer == 0 and info.end_layer == mc.num_hidden_layers
        store.load_model(model_kv(configurator.model, info.start_layer, info.end_layer, int(mc.context_len),
                                  str(mc.model_path), whole))
    return store_pool_class()(
        store, mc.num_attention_heads // tp, rows, max_total_num_tokens, page_size=configurator.pool_page_size,
        dtype=configurator.kv_cache_dtype, head_num=mc.get_num_kv_heads(tp), head_dim=mc.head_dim,
        v_head_dim=mc.v_head_dim, layer_num=configurator.layer_info.num_effective_layers,
        device=configurator.device, enable_memory_saver=get_exec().features.enable_memory_saver,
        start_layer=configurator.layer_info.start_layer, end_layer=configurator.layer_info.end_layer)


_POOL_CLASS: type | None = None


def store_pool_class() -> type:
    """:class:`SparseStorePool`, defined on first use (it subclasses an SGLang class)."""
    global _POOL_CLASS
    if _POOL_CLASS is None:
        _POOL_CLASS = _define_pool_class()
    return _POOL_CLASS


def _define_pool_class() -> type:
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, get_tensor_size_bytes

    class SparseStorePool(MHATokenToKVPool):
        """SGLang's MHA pool with a :class:`KVStore`'s buffers and write path."""

        def __init__(self, store: KVStore, num_q_heads: int, max_requests: int, *args: Any, **kwargs: Any) -> None:
            self.store = store
            self.num_q_heads = num_q_heads
            self.max_requests = max_requests
            super().__init__(*args, **kwargs)

        def geometry(self) -> KVGeometry:
            return KVGeometry(num_layers=self.layer_num, num_q_heads=self.num_q_heads, num_kv_heads=self.head_num,
                              head_dim=self.head_dim, page_size=self.page_size, num_slots=self.size + self.page_size,
                              dtype=self.dtype, device=torch.device(self.device), max_requests=self.max_requests)

        def _create_buffers(self) -> None:
            if self.post_capture_active or self.kv_cache_layout != "nhd" or self.start_layer != 0:
                raise ValueError("sgl_sparse: a method-owned KV layout needs the plain NHD pool of every layer "
                                 "(no post-capture sizing, HND layout or pipeline stages)")
            if self.v_head_dim != self.head_dim:
                raise ValueError(f"sgl_sparse: {type(self.store).__name__} needs equal K and V head dims "
                                 f"({self.head_dim} and {self.v_head_dim})")
            self.k_scale_buffer = self.v_scale_buffer = self.dq_k_buffer = self.dq_v_buffer = None
            with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
                self.store.allocate(self.geometry())
            self.k_buffer = [self.store.slot_tensors(i)[0] for i in range(self.layer_num)]
            self.v_buffer = [self.store.slot_tensors(i)[1] for i in range(self.layer_num)]
            self._kv_buffer_descs: list[Any] = []  # PD transfer and post-capture backing only, both refused
            self._init_data_ptrs_and_strides()

        def _slot_move_pointer_buffers(self) -> list[torch.Tensor]:
            return [t for i in range(self.layer_num) for t in self.store.slot_tensors(i)]

        def move_kv_cache(self, tgt_loc: Any, src_loc: Any) -> None:
            if self.store.slot_move_problem is not None:
                raise RuntimeError(f"sgl_sparse: {type(self.store).__name__}: {self.store.slot_move_problem}")
            super().move_kv_cache(tgt_loc, src_loc)

        def get_kv_size_bytes(self) -> tuple[int, int]:
            # What sizing counted: the per-token layout (K codes, then the rest) and the fixed buffers.
            k = sum(get_tensor_size_bytes(self.store.slot_tensors(i)[0]) for i in range(self.layer_num))
            total = self.store.bytes_per_token(self.geometry()) * (self.size + self.page_size)
            return k, total - k + self.store.fixed_bytes(self.geometry())

        def set_kv_buffer(self, *args: Any, **kwargs: Any) -> None:
            # Our attention backend writes through the store with each token's row (KVStore.write); a
            # write without one would skip what per-request layouts keep aside.
            raise RuntimeError(f"sgl_sparse: K/V of a {type(self.store).__name__} layout is written by sgl_sparse's "
                               "attention backend (KVStore.write), not through set_kv_buffer")

        def get_cpu_copy(self, indices: Any, mamba_indices: Any = None) -> Any:
            raise NotImplementedError("sgl_sparse: host copies of a method-owned KV layout (HiCache) are not supported")

        def load_cpu_copy(self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None) -> Any:
            raise NotImplementedError("sgl_sparse: host copies of a method-owned KV layout (HiCache) are not supported")

    return SparseStorePool
