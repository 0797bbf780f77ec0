"""Process-wide runtime of a scheduler process: the method, per-request states, the eviction step.

Scheduler, tree and model runner share one process (per TP rank), so module state is the natural
place for what they share. The attention backend reaches a request's state through
``ForwardBatch.rids``; the step hooks through ``ScheduleBatch.reqs``.

The truth about which positions a request retains is its ``req_to_token`` row: a position holds a
slot, or ``SENTINEL_SLOT`` once evicted. The runtime keeps the same set on the host
(``RequestState.kept``, from the tree's match view at admission and from every plan it applies), so
the per-step decision, the plan checks and the graph-decode plan lengths need no device sync. Jobs:

* :mod:`.capture` - window queries of observing methods;
* :mod:`.tables` - per-request device tables indexed by ``req_pool_idx`` (decode live counts);
* :mod:`.step` - the after-forward step planner: observe, plan, one batched apply per step;
* :mod:`.frees` - slots freed by eviction, ordered against the schedule stream;
* :mod:`.metrics` - Prometheus gauges and counters (``--enable-metrics``);
* this module - request states and the hooks around each forward step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.contract import PrefillChunk, RequestState, SparseMethod
from sgl_sparse.integration import handoff, step
from sgl_sparse.integration.capture import QueryCapture
from sgl_sparse.integration.frees import PendingFrees
from sgl_sparse.integration.syncs import no_host_sync
from sgl_sparse.integration.tables import DeviceTables
from sgl_sparse.prune.spec import KVZIP_GLOBAL, SNAPKV_WINDOW
from sgl_sparse.registry import create_method
from sgl_sparse.request_methods import (
    EVICTION,
    PRUNE_KEY,
    MethodResolver,
    RequestMethodError,
    Served,
    parse_prune_param,
    prune_problem,
)
from sgl_sparse.rules import served_hooks_problem
from sgl_sparse.slots import retained_positions

logger = logging.getLogger(__name__)
SERVED_ATTR = "_sgl_sparse_served"  # set on SGLang's Req at admission: the Served method of the request
PRUNE_ATTR = "_sgl_sparse_prune"  # set on SGLang's Req at admission: its own prune (a PruneSpec), or absent
ANY_RESULT = object()  # run_deferred: whichever forward the deferred step is of


def multimodal_replay_problem(req: Any, method: SparseMethod[Any], prune: Any) -> str | None:
    """Why ``req`` cannot be served here, or None: replay forwards (KVzip's reconstruction, a ``kvzip_global``
    prune) run text tokens after the context, whose M-RoPE positions in a request with images or video depend on
    its multimodal inputs, which a replay batch does not carry (integration/replay.py)."""
    if getattr(req, "multimodal_inputs", None) is None:
        return None
    if method.runs_replays:
        return (f"sgl_sparse: {method.name} scores by replay forwards, which are not served for requests with "
                "multimodal inputs; send text, or use another method")
    if prune is not None and getattr(prune, "policy", None) == KVZIP_GLOBAL:
        return (f"custom_params.sgl_sparse_prune: {KVZIP_GLOBAL} scores by replay forwards, which are not served "
                "for requests with multimodal inputs; use knorm or snapkv_global")
    return None


@dataclass
class Counters:
    evicted_tokens_total: int = 0
    chain_hits_total: int = 0
    chain_hit_tokens_total: int = 0  # logical tokens of the matched prefixes (what cached_tokens counts)
    chain_hit_kept_tokens_total: int = 0  # of them, with resident KV (physical)
    eviction_steps_total: int = 0
    unscored_prunes_total: int = 0  # requests' own scored prunes not applied (kvzip_global with no replay room)
    # Extend steps with a cached prefix under a store that reads it dequantized (prefix_attention "dequantize"):
    # read so, or through the store's kernel (past the token cap).
    prefix_dequantized_steps_total: int = 0
    prefix_kernel_steps_total: int = 0
    # Replay plans (KVzip's, a kvzip_global prune's) whose room was bound by KV memory (free slots plus what the
    # tree could evict) rather than by the context: their chunks may be shorter than on an idle server.
    replay_room_memory_bound_total: int = 0
    # Times SGLang's idle checks (pool leak, request pool, tree) ran and passed: a client that saw the server idle
    # waits for this to move to know a check ran after its requests, instead of sleeping.
    idle_checks_passed_total: int = 0


@dataclass
class Tracked:
    """A request the runtime follows: its method and that method's state, plus what the step needs."""

    state: RequestState
    pool_idx: int
    method: SparseMethod[Any]
    prompt_done: bool = False
    # Its own prune asked for evict_branches and hid positions: at finish the tree evicts the idle branches off its
    # path from this logical position (the first range's start) before freeing what it hid.
    evict_branches_after: int | None = None
    pruned: bool = False  # its own prune hid positions (the tree then treats cached continuations as a prune does)


@dataclass
class SparseRuntime:
    method: SparseMethod[Any]  # the server's (--sparse-method): what requests that choose none get
    fingerprint: str
    # Which method each request gets (custom_params, sgl_sparse/request_methods.py); None: always `method`.
    resolver: MethodResolver | None = None
    tracked: dict[str, Tracked] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    serving: bool = False  # set when our tree is built: this scheduler serves through sgl_sparse
    metrics: Any = None  # SparseMetrics with --enable-metrics
    capture: QueryCapture = field(init=False)
    frees: PendingFrees = field(default_factory=PendingFrees)
    tables: DeviceTables = field(default_factory=DeviceTables)
    # Exact live KV lengths of the decode batch about to run (CPU int32, batch order), for the graph
    # decode plan; None when unknown (the backend then lets FlashInfer read them from the device).
    decode_live_lens: torch.Tensor | None = None
    # The replay forward running now (KVzip's reconstruction, integration/replay.py): the backend hands it each
    # layer's queries and keys; None otherwise.
    replay: Any = None
    # The kvzip config a request's own prune with policy kvzip_global replays with (its instructions tokenized by
    # the launcher); None where the launcher found it cannot be served (the request is refused at admission).
    prune_replays: Any = None
    # This scheduler's SparseRadixCache (set where the plugin builds it): replays evict from it for their slots.
    tree: Any = None
    # The last forward's decode-token step, waiting for the results before it to be processed (step.py).
    deferred: step.Deferred | None = None

    # Whether any request may evict (the server's method, or one a request chooses): rows may then hold
    # sentinels, so attention reads compacted lists; fixed.
    evicting: bool = field(init=False)
    # Whether any request may capture window queries, in prefill / in decode; fixed.
    observes: bool = field(init=False)
    observes_decode: bool = field(init=False)
    # Whether any per-request work is needed (dense: none, the stock path runs untouched); fixed.
    active: bool = field(init=False)

    def __post_init__(self) -> None:
        m = self.method
        if (why := served_hooks_problem(m)) is not None:
            raise ValueError(f"sgl_sparse: {why}")
        per_request = self.resolver is not None and self.resolver.policy == EVICTION
        self.evicting = m.evicts or per_request
        # An evicting server's requests may prune their own prompts with a scored keep, which reads the prompt's
        # last queries: capture in prefill there (a request that needs none costs a dict lookup per layer).
        self.observes = m.observation_window() > 0 or self.evicting
        self.observes_decode = (m.observation_window() > 0 and m.observes_decode()) or per_request
        self.active = self.evicting or self.observes
        self.capture = QueryCapture()
        self._default = Served(m, self.fingerprint, "server")

    @property
    def states(self) -> dict[str, RequestState]:
        return {rid: t.state for rid, t in self.tracked.items()}

    # -- which method serves a request ------------------------------------------------------------
    def admit(self, req: Any) -> None:
        """At admission (before the request first enters the waiting queue): resolve its method and, when it
        is not the server's config, move it into that config's prefix-tree namespace through ``extra_key``
        (which every stock match and insert of SGLang reads). Idempotent (a retracted request comes back)."""
        if hasattr(req, SERVED_ATTR):
            return
        served = self._default
        if self.resolver is not None:
            custom_params = getattr(req.sampling_params, "custom_params", None)
            try:
                served = self.resolver.resolve(custom_params)
                if isinstance(custom_params, dict) and PRUNE_KEY in custom_params:
                    spec = parse_prune_param(custom_params[PRUNE_KEY], len(req.origin_input_ids))
                    if (why := prune_problem(self.resolver, spec)) is not None:
                        raise RequestMethodError(PRUNE_KEY, why)
                    setattr(req, PRUNE_ATTR, spec)
            except RequestMethodError as e:
                # The HTTP process validates every request first; this is a request that bypassed it.
                req.set_finish_with_abort(f"custom_params.{e.key}: {e}")
        if (why := multimodal_replay_problem(req, served.method, getattr(req, PRUNE_ATTR, None))) is not None:
            req.set_finish_with_abort(why)
        setattr(req, SERVED_ATTR, served)
        if served.fingerprint != self.fingerprint:
            ns = f"sgl_sparse={served.fingerprint}"
            req.extra_key = ns if not req.extra_key else f"{ns}:{req.extra_key}"

    def served(self, req: Any) -> Served:
        s = getattr(req, SERVED_ATTR, None)
        if s is None:
            self.admit(req)
            s = getattr(req, SERVED_ATTR)
        return s

    def window_for(self, req: Any) -> int:
        """The prompt's last queries ``req``'s final prefill reads: its method's observation window and, where its
        own prune scores the ranges with the prompt's last queries (snapkv_global; knorm reads keys only, but one
        window for both keeps this simple), at least SnapKV's; the method is handed only its own (step._window).
        The tree leaves these positions to be computed on a dense prefix hit (``SparseRadixCache.window_for``)."""
        window = self.served(req).method.observation_window()
        spec = getattr(req, PRUNE_ATTR, None)
        if spec is not None and spec.needs_window:
            window = max(window, SNAPKV_WINDOW)
        return window

    def evicts_for(self, req: Any) -> bool:
        """Whether ``req``'s method evicts, or it prunes its own prompt (either way the tree defers its insertion
        to finish and keeps its holes)."""
        return self.served(req).method.evicts or hasattr(req, PRUNE_ATTR)

    def requests_by_method(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tracked.values():
            out[t.method.name] = out.get(t.method.name, 0) + 1
        return out

    # -- request states ------------------------------------------------------------------------
    def track(self, req: Any) -> Tracked:
        """The request's record, created at its first forward step from its match view (admission)."""
        t = self.tracked.get(req.rid)
        if t is not None:
            return t
        from sgl_sparse.radix.records import VIEW_ATTR

        method = self.served(req).method
        st = method.new_state(req.rid)
        n_prefix = len(req.prefix_indices)
        view = getattr(req, VIEW_ATTR, None)
        if n_prefix:
            payload = None
            if view is not None and view.length == n_prefix:
                st.set_kept(view.kept, logical_len=n_prefix)
                payload = view.payload
            elif method.evicts:
                # No view for this prefix (the tree always leaves one: an SGLang path we do not know).
                # The row may hold holes: read the truth from the device once rather than guess.
                logger.warning("sgl_sparse: request %s has no match view for its %d-token prefix; reading its "
                               "retained positions from the device", req.rid, n_prefix)
                st.set_kept(retained_positions(req.prefix_indices[:n_prefix]), logical_len=n_prefix)
            else:  # dense: no hole can exist
                st.set_kept(torch.arange(n_prefix), logical_len=n_prefix)
            if st.num_kept < n_prefix:
                self.counters.chain_hits_total += 1
                self.counters.chain_hit_tokens_total += n_prefix
                self.counters.chain_hit_kept_tokens_total += st.num_kept
            method.restore_state(st, payload)
        t = Tracked(st, int(req.req_pool_idx), method)
        self.tracked[req.rid] = t
        window = self.window_for(req)
        if window > 0:
            self.capture.start(req.rid, window, method.observation_window() > 0 and method.observes_decode())
        return t

    def finish(self, req: Any) -> Any:
        """The request finished, was aborted or retracted (tree callback): its kept set and payload for
        the tree; drops every per-request structure."""
        from sgl_sparse.radix.records import FinishedState

        self.capture.drop(req.rid)
        t = self.tracked.pop(req.rid, None)
        if t is None:
            return None
        payload = t.method.on_finish(t.state)
        return FinishedState(kept=t.state.kept, payload=payload, tail_start=t.state.tail_start,
                             evict_branches_after=t.evict_branches_after, pruned=t.pruned,
                             sparse_from=t.state.sparse_from, logical_len=t.state.logical_len)

    @staticmethod
    def kv_slots_used(allocator: Any) -> int:
        """Physical slots not free: held by running requests or by the prefix tree."""
        return int(allocator.size - allocator.available_size())

    def logical_tokens_running(self) -> int:
        return sum(t.state.logical_len for t in self.tracked.values())

    def kept_tokens_running(self) -> int:
        return sum(t.state.num_kept for t in self.tracked.values())

    # -- attention-side capture ------------------------------------------------------------------
    def capture_queries(self, layer_id: int, q: torch.Tensor, rids: list[str], q_lens: list[int],
                        scale: float) -> None:
        self.capture.record(layer_id, q, rids, q_lens, scale)

    # -- around the forward step -----------------------------------------------------------------
    def before_forward(self, batch: Any, model_runner: Any) -> None:
        """Before the step's forward: admission (``new_state``/``restore_state``) and
        ``on_prefill_chunk`` of each prefill chunk; inputs of a decode step: exact live lengths for
        the graph decode plan (host) and for the KV list build (device table)."""
        self.frees.flush_late()
        # The last forward's decode step is still deferred when no result was processed after its launch: SGLang
        # processed the one before first (a batch it does not overlap, e.g. a mixed chunk after a prefill with
        # SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP), so the step runs now, before this forward, still after
        # the results before it. Its frees wait for the barrier after this launch.
        self.run_deferred(hand_frees=False)
        self.decode_live_lens = None
        with no_host_sync():
            self.tables.done()
        if not self.active or batch is None or not batch.reqs:
            return
        mode = batch.forward_mode
        if mode.is_extend():
            self._before_prefill(batch)
            return
        if not self.evicting or not mode.is_decode():
            return
        with no_host_sync():
            self._before_decode(batch, model_runner)

    def _before_decode(self, batch: Any, model_runner: Any) -> None:
        lens = []
        for req in batch.reqs:
            t = self.tracked.get(req.rid)
            if t is None:
                return
            lens.append(t.state.num_kept + 1)  # the retained set plus this step's token
        self.decode_live_lens = torch.tensor(lens, dtype=torch.int32)
        self.tables.set_decode(model_runner.req_to_token_pool.req_to_token, batch.req_pool_indices,
                               self.decode_live_lens, batch.seq_lens_cpu.tolist() if self.tables.check else [])

    def _before_prefill(self, batch: Any) -> None:
        seq_lens = batch.seq_lens_cpu.tolist()
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.req_pool_idx is None:
                continue
            t = self.track(req)
            if t.prompt_done:
                continue  # a decode token inside a mixed step
            total = len(req.origin_input_ids) + len(req.output_ids)
            t.method.on_prefill_chunk(t.state, PrefillChunk(t.state.logical_len, int(seq_lens[i]), total))

    def after_forward(self, batch: Any, model_runner: Any, result: Any = None) -> None:
        self.decode_live_lens = None
        with no_host_sync():
            self.tables.done()
        if self.active and batch is not None and batch.reqs:
            with no_host_sync(batch.forward_mode.is_decode()):
                self.deferred = step.run(self, batch, model_runner, result)
        sel = self.method.selector
        if sel is not None and sel.maintains and batch is not None and batch.reqs:
            from sgl_sparse.integration.selection import after_step

            with no_host_sync():
                after_step(sel, batch, model_runner)
        if self.metrics is not None and self.deferred is None:  # else run_deferred updates them after its step
            self.metrics.update(self, model_runner.token_to_kv_pool_allocator)

    def run_deferred(self, *, of_result: Any = ANY_RESULT, hand_frees: bool = True) -> None:
        """The deferred decode step (step.py), from around SGLang's result processing: before processing a
        result only if the step is that forward's own (``of_result``: no overlap, or a batch SGLang does not
        overlap), else after it (that result is the previous forward's, whose processing marked the requests
        it finished). Its frees are handed to the allocator here, on the schedule stream, after the step's
        writes on the forward's stream (``hand_frees``; else at the next barrier, integration/frees.py)."""
        d = self.deferred
        if d is None or (of_result is not ANY_RESULT and d.result is not of_result):
            return
        self.deferred = None
        with no_host_sync(d.decode):
            step.run_deferred(self, d)
        if d.stream is not None and hand_frees:
            self.frees.flush_on_current_stream()
        if self.metrics is not None:
            self.metrics.update(self, d.model_runner.token_to_kv_pool_allocator)


_runtime: SparseRuntime | None = None


def prune_replay_config(prompts: dict[str, list[int]] | None) -> Any:
    """The ``kvzip`` config (defaults, the launcher's tokenized instructions) of ``kvzip_global`` prunes; None
    without instructions (not served here)."""
    if prompts is None:
        return None
    from sgl_sparse.methods.eviction.kvzip import KVzipConfig

    return KVzipConfig(**prompts)


def get_runtime() -> SparseRuntime:
    """Build (first call) or return this process's runtime. Config errors raise here, loudly."""
    global _runtime
    if _runtime is None:
        h = handoff.read()
        method = create_method(h.method, h.config)
        resolver = MethodResolver(method, h.request_methods, h.decode_graphs, h.scored_prune_problem,
                                  h.replay_prune_problem)
        _runtime = SparseRuntime(method=method, fingerprint=method.config.fingerprint(), resolver=resolver,
                                 prune_replays=prune_replay_config(h.replay_prompts))
    return _runtime
