"""Entry point of group ``sglang.srt.plugins`` (see pyproject.toml).

SGLang calls :func:`register` through ``load_plugins()`` in the launcher and first thing in every
scheduler process (spawned, so nothing set up in the parent survives; tests may fork them instead, see
``MP_START_ENV``). It must be idempotent, cheap
and must not change vanilla behaviour: it only *adds* backends named ``sgl_sparse``, a field in
``/server_info`` of servers that use them, and, on hosts without CUDA, the CPU fallbacks of
:mod:`.cpu_support` (without which SGLang 0.5.17 cannot build a model on CPU at all).

SGLang logs plug-in exceptions instead of raising them, so :func:`check_registered` lets the launcher
fail loudly if registration did not happen.
"""

from __future__ import annotations

import logging
import os

from sgl_sparse.integration import BACKEND_NAME, handoff

logger = logging.getLogger(__name__)
_registered = False


def _is_cpu_server() -> bool:
    device = handoff.read().device
    if device is not None:
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _tree_factory(ctx):  # ctx: sglang.srt.mem_cache.registry.TreeCacheBuildContext
    from sgl_sparse.integration.runtime import get_runtime
    from sgl_sparse.radix.tree import SparseRadixCache
    from sgl_sparse.rules import pool_page_size

    unsupported = {
        "hybrid SWA models": ctx.is_hybrid_swa,
        "hybrid SSM/Mamba models": ctx.is_hybrid_ssm,
        "--enable-hierarchical-cache (HiCache)": ctx.enable_hierarchical_cache,
        "--enable-session-radix-cache": ctx.server_args.enable_session_radix_cache,
    }
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"sgl_sparse: not supported yet: {', '.join(bad)}")
    rt = get_runtime()
    if ctx.params.page_size != pool_page_size(rt.method):
        raise ValueError(f"sgl_sparse: page size {ctx.params.page_size}: {rt.method.name} is served with page size "
                         f"{pool_page_size(rt.method)} (start the server with python -m sgl_sparse.launch_server)")
    rt.serving = True
    # Overlap scheduling on a GPU: evicted slots go back to the allocator on the schedule stream
    # (integration/frees.py).
    rt.frees.deferred = not ctx.server_args.disable_overlap_schedule and ctx.server_args.device != "cpu"
    if ctx.server_args.enable_metrics:
        from sgl_sparse.integration.metrics import SparseMetrics

        rt.metrics = SparseMetrics(rt.method.name)
    tree = SparseRadixCache(ctx.params, rt.method, rt.fingerprint, on_finish=rt.finish, evicts_for=rt.evicts_for,
                            evicting=rt.evicting, window_for=rt.window_for)
    rt.tree = tree
    if rt.evicting:
        from sgl_sparse.integration.chat_resume import load_suffix

        tree.resume_suffix = load_suffix(ctx.server_args)
        logger.info("sgl_sparse: Chain Cache resumes a next turn from %d token(s) before a chat prompt's end "
                    "(the chat template's generation prompt)", len(tree.resume_suffix))
    return tree


def _attention_factory(runner):
    from sgl_sparse.integration.backends import create_backend

    return create_backend(runner)


def _around_forward(original, worker, batch=None, *args, **kwargs):  # type: ignore[no-untyped-def]
    """AROUND ``TpModelWorker.forward_batch_generation``: host-side inputs of the step before it (the
    graph decode plan's live lengths), the physical eviction step after it: a prefill chunk's right
    after the forward of ``batch`` is launched, before its results are processed or the next batch is
    prepared; a decode token's deferred to around the result processing (integration/step.py)."""
    from sgl_sparse.integration.runtime import get_runtime

    rt = get_runtime()
    if not rt.serving:  # only in servers whose tree is ours
        return original(worker, batch, *args, **kwargs)
    rt.before_forward(batch, worker.model_runner)
    result = original(worker, batch, *args, **kwargs)
    rt.after_forward(batch, worker.model_runner, result)
    return result


def _around_process_batch_result(original, scheduler, *args, **kwargs):  # type: ignore[no-untyped-def]
    """AROUND ``Scheduler.process_batch_result``: the deferred decode step of the last forward (step.py) runs
    before this processing if it is that forward's own result, else right after it (overlap scheduling: this
    is the forward before, and the requests it finished must be skipped)."""
    from sgl_sparse.integration.runtime import get_runtime

    rt = get_runtime()
    if not rt.serving:
        return original(scheduler, *args, **kwargs)
    result = args[1] if len(args) > 1 else kwargs.get("result")
    rt.run_deferred(of_result=result)
    out = original(scheduler, *args, **kwargs)
    rt.run_deferred()
    return out


def _after_war_barrier(result, scheduler, *args, **kwargs):  # type: ignore[no-untyped-def]
    """AFTER ``Scheduler._apply_war_barrier`` (on the schedule stream, right after each launch under
    overlap scheduling): hand the slots evicted by that step to the allocator there."""
    from sgl_sparse.integration.runtime import get_runtime

    rt = get_runtime()
    if rt.serving:
        rt.frees.flush_on_current_stream()
    return result


def _before_sleep_on_idle(scheduler, *args, **kwargs):  # type: ignore[no-untyped-def]
    """BEFORE ``Scheduler.maybe_sleep_on_idle``, which ``Scheduler.on_idle`` calls only after its leak checks
    passed on a fully idle scheduler (a failed strict check raises before it)."""
    from sgl_sparse.integration.runtime import get_runtime

    get_runtime().counters.idle_checks_passed_total += 1


# Tests only: "fork" starts SGLang's scheduler and detokenizer by forking the launcher, which has imported
# SGLang already, instead of spawning fresh interpreters that import it again (seconds of CPU each on a CPU host).
# The children then inherit the launcher's modules and patches; servers that check the production path keep spawn.
MP_START_ENV = "SGLSPARSE_MP_START"
MP_START_CHOICES = ("spawn", "fork")


def mp_start_method() -> str:
    method = os.environ.get(MP_START_ENV, "spawn")
    if method not in MP_START_CHOICES:
        raise RuntimeError(f"{MP_START_ENV}={method!r}: one of {', '.join(MP_START_CHOICES)}")
    return method


def _after_set_envs_and_config(result, *args, **kwargs):  # type: ignore[no-untyped-def]
    """AFTER ``engine._set_envs_and_config``, which sets SGLang's children's start method to spawn."""
    import multiprocessing as mp

    mp.set_start_method(mp_start_method(), force=True)
    return result


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, _tree_factory)
    ATTENTION_BACKENDS[BACKEND_NAME] = _attention_factory
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])

    from sgl_sparse.integration.server_info import after_get_internal_state

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state", after_get_internal_state, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", _around_forward, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._apply_war_barrier", _after_war_barrier, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle", _before_sleep_on_idle, HookType.BEFORE
    )
    if mp_start_method() != "spawn":
        HookRegistry.register("sglang.srt.entrypoints.engine._set_envs_and_config", _after_set_envs_and_config,
                              HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.process_batch_result", _around_process_batch_result,
        HookType.AROUND
    )
    from sgl_sparse.integration.kv_pool import (
        after_profile_available_bytes,
        around_build_mha_kv_pool,
        around_build_token_to_kv_pool,
        around_cell_size,
    )

    # A store's bytes per token replace SGLang's KV cell (more tokens for fewer bytes); a selector's page
    # metadata is added to it (the pool shrinks by it). A store also builds the pool.
    HookRegistry.register("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
                          around_cell_size, HookType.AROUND)
    configurator = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
    HookRegistry.register(f"{configurator}._build_mha_kv_pool", around_build_mha_kv_pool, HookType.AROUND)
    HookRegistry.register(f"{configurator}._build_token_to_kv_pool", around_build_token_to_kv_pool, HookType.AROUND)
    HookRegistry.register(f"{configurator}._profile_available_bytes", after_profile_available_bytes, HookType.AFTER)
    from sgl_sparse.integration import validation

    # Rejects bad requests in the HTTP process (the TokenizerManager's), only in servers whose tree is ours.
    HookRegistry.register(validation.TARGET, validation.before_generate_request, HookType.BEFORE)
    from sgl_sparse.integration import per_request

    # Per-request methods: the method in each response's meta_info (HTTP process), and each request's method
    # and prefix-tree namespace at admission (scheduler).
    HookRegistry.register(per_request.WAIT_TARGET, per_request.around_wait_one_response, HookType.AROUND)
    HookRegistry.register(per_request.ADMIT_TARGET, per_request.before_add_request_to_queue, HookType.BEFORE)
    for target in per_request.OPENAI_RESPONSE_TARGETS:  # and in a non-streaming OpenAI response's metadata
        HookRegistry.register(target, per_request.after_build_openai_response, HookType.AFTER)
    from sgl_sparse.integration import prune_route

    # Prefix-Cache Pruning's control request, handled by each scheduler between batches.
    HookRegistry.register(prune_route.DISPATCHER_TARGET, prune_route.after_init_request_dispatcher, HookType.AFTER)
    HookRegistry.register(prune_route.CHAT_CONVERT_TARGET, prune_route.after_convert_chat_request, HookType.AFTER)
    if _is_cpu_server():
        from sgl_sparse.integration.cpu_support import register_cpu_support

        register_cpu_support()
    _registered = True


def check_registered() -> None:
    """Raise if :func:`register` did not run or did not take effect in this process."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    if not _registered or BACKEND_NAME not in ATTENTION_BACKENDS or BACKEND_NAME not in (
        registered_radix_cache_backends()
    ):
        raise RuntimeError(
            "sgl_sparse: the SGLang plug-in did not register (is the package installed, so that its "
            "'sglang.srt.plugins' entry point exists, and SGLANG_PLUGINS not excluding 'sgl_sparse'?)"
        )
