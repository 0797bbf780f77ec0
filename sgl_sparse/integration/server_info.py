"""The ``sgl_sparse`` block in ``/server_info`` -> ``internal_states[i]``.

An AFTER hook on ``Scheduler.get_internal_state`` (managers/scheduler.py L4165) adds what the
scheduler process actually built, so a client can check which tree and attention backend serve it.
"""

from __future__ import annotations

from typing import Any

from sgl_sparse.compose import family_label
from sgl_sparse.integration import handoff
from sgl_sparse.integration.runtime import get_runtime


def prefill_cuda_graph(scheduler: Any, hand: handoff.Handoff) -> str:
    """Who decided the prefill CUDA graph and what it is: the launcher turns it off for methods that
    capture prefill queries and on evicting servers (a request's own scored prune captures them), and on CPU;
    otherwise it is SGLang's, as resolved in the scheduler's args."""
    if hand.prefill_cuda_graph_off:
        return f"disabled by sgl_sparse: {hand.prefill_cuda_graph_off}"
    config = getattr(scheduler.server_args, "cuda_graph_config", None)
    backend = getattr(getattr(config, "prefill", None), "backend", None)
    return "sglang default" if backend is None else f"sglang: {backend}"


def scheduler_sparse_state(scheduler: Any) -> dict[str, Any]:
    rt = get_runtime()
    tree = scheduler.tree_cache
    runner = scheduler.tp_worker.model_runner
    total = int(scheduler.max_total_num_tokens)
    hand = handoff.read()
    state: dict[str, Any] = {
        "method": rt.method.name,
        "family": family_label(rt.method),
        # Which scheduler answers: under --dp-size each rank has its own tree and counters, and SGLang lists the
        # ranks' states in the order they arrive.
        "dp_rank": getattr(getattr(scheduler, "ps", None), "dp_rank", None),
        "tp_rank": getattr(getattr(scheduler, "ps", None), "tp_rank", None),
        "config": rt.method.config.to_dict(),
        "fingerprint": rt.fingerprint,
        # What a request may choose through custom_params (--sparse-request-methods), and the methods of the
        # requests running now.
        "request_methods": rt.resolver.policy if rt.resolver is not None else "off",
        "requests_by_method": rt.requests_by_method(),
        # Decode queries a request keeps on the device (the ring decode CUDA graphs write; 0: none observes decode)
        # and its bytes, from the KV budget.
        "decode_window": rt.decode_window,
        "decode_ring_bytes": sum(t.numel() * t.element_size() for t in rt.capture.ring or []),
        "tree_class": type(tree).__name__,
        "attention_backend_class": type(runner.attn_backend).__name__,
        "attention_base": hand.base,
        "prefill_cuda_graph": prefill_cuda_graph(scheduler, hand),
        "kv_slots_total": total,
        "kv_slots_used": rt.kv_slots_used(scheduler.token_to_kv_pool_allocator),
        "logical_tokens_running": rt.logical_tokens_running(),
        "kept_tokens_running": rt.kept_tokens_running(),
        "requests_tracked": len(rt.tracked),
        # Decode rows whose host live count disagreed with their row (a bug if ever non-zero; read
        # back without a sync, so it may trail by a step).
        "decode_count_mismatches": rt.tables.read_mismatches(),
        **vars(rt.counters),
    }
    if method_stats := rt.method.stats():
        state["method_stats"] = method_stats  # e.g. PyramidKV: the union it holds vs the layer sets it reads
    pool = runner.token_to_kv_pool
    store = getattr(pool, "store", None)
    if store is not None:
        # The method-owned layout: what one token costs over all layers, and the tokens that bought.
        state["kv_store"] = {"class": type(store).__name__, "pool_class": type(pool).__name__,
                             "bytes_per_token": store.bytes_per_token(pool.geometry()), **store.describe()}
    if hasattr(tree, "stats"):
        state.update(tree.stats())
    return state


def after_get_internal_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    from sgl_sparse.radix.tree import SparseRadixCache

    # The plug-in is loaded by every SGLang server on the host; report only where our tree serves.
    if isinstance(scheduler.tree_cache, SparseRadixCache):
        result.internal_state["sgl_sparse"] = scheduler_sparse_state(scheduler)
    return result
