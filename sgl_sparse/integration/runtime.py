"""Process-wide runtime of a scheduler process: the method, per-request records, the eviction step.

Scheduler, tree and model runner share one process (per TP rank), so module state is the natural
place for what they share. Each request's state lives in one record (:class:`~sgl_sparse.request.SparseRequest`),
made at admission and reached from SGLang's ``Req`` through its one handle; the attention backend, which sees a
batch's requests by ``ForwardBatch.rids`` only, reaches the capturing ones through :mod:`.capture`.

The truth about which positions a request retains is its ``req_to_token`` row: a position holds a
slot, or ``SENTINEL_SLOT`` once evicted. The runtime keeps the same set on the host
(``RequestState.kept``, from the tree's match view at admission and from every plan it applies), so
the per-step decision, the plan checks and the graph-decode plan lengths need no device sync. Jobs:

* :mod:`.capture` - window queries of observing methods;
* :mod:`.tables` - per-request device tables indexed by ``req_pool_idx`` (decode live counts);
* :mod:`.step` - the after-forward step planner (:class:`~.step.StepPlanner`, owned here): observe, plan, one
  batched apply per step;
* :mod:`.frees` - slots freed by eviction, ordered against the schedule stream;
* :mod:`.metrics` - the counters, and Prometheus gauges and counters (``--enable-metrics``);
* :mod:`.replay` - replay forwards (KVzip's), each carrying its own context on its forward batch;
* this module - admission, request records and the hooks around each forward step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.contract import PrefillChunk, RequestState, SparseMethod
from sgl_sparse.integration import handoff
from sgl_sparse.integration.capture import QueryCapture
from sgl_sparse.integration.frees import PendingFrees
from sgl_sparse.integration.metrics import Counters
from sgl_sparse.integration.step import Deferred, StepPlanner
from sgl_sparse.integration.syncs import no_host_sync
from sgl_sparse.integration.tables import DeviceTables
from sgl_sparse.prune.spec import KVZIP_GLOBAL, SNAPKV_WINDOW
from sgl_sparse.request import SparseRequest, attach, match_view, record_of
from sgl_sparse.request_methods import (
    EVICTION,
    PRUNE_KEY,
    MethodResolver,
    RequestMethodError,
    Served,
    parse_prune_param,
    prune_problem,
)
from sgl_sparse.rules import decode_window, served_hooks_problem
from sgl_sparse.slots import retained_positions

logger = logging.getLogger(__name__)
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
class SparseRuntime:
    method: SparseMethod[Any]  # the server's (--sparse-method): what requests that choose none get
    fingerprint: str
    # Which method each request gets (custom_params, sgl_sparse/request_methods.py); None: always `method`.
    resolver: MethodResolver | None = None
    # The records of the requests whose run started (first forward step) and has not finished, by rid.
    tracked: dict[str, SparseRequest] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    serving: bool = False  # set when our tree is built: this scheduler serves through sgl_sparse
    metrics: Any = None  # SparseMetrics with --enable-metrics
    capture: QueryCapture = field(init=False)
    frees: PendingFrees = field(default_factory=PendingFrees)
    tables: DeviceTables = field(default_factory=DeviceTables)
    # Exact live KV lengths of the decode batch about to run (CPU int32, batch order), for the graph
    # decode plan; None when unknown (the backend then lets FlashInfer read them from the device).
    decode_live_lens: torch.Tensor | None = None
    # The kvzip config a request's own prune with policy kvzip_global replays with (its instructions tokenized by
    # the launcher); None where the launcher found it cannot be served (the request is refused at admission).
    prune_replays: Any = None
    # The last forward's decode-token step, waiting for the results before it to be processed (step.py).
    deferred: Deferred | None = None
    planner: StepPlanner = field(init=False)

    # Whether any request may evict (the server's method, or one a request chooses): rows may then hold
    # sentinels, so attention reads compacted lists; fixed.
    evicting: bool = field(init=False)
    # Whether any request may capture window queries, in prefill / in decode; fixed.
    observes: bool = field(init=False)
    # Decode queries a request keeps in the device ring (capture.py), 0 where no request observes decode; fixed.
    decode_window: int = field(init=False)
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
        self.decode_window = self.resolver.decode_window if self.resolver is not None else decode_window(m)
        self.active = self.evicting or self.observes
        self.capture = QueryCapture()
        self._default = Served(m, self.fingerprint, "server")
        self.planner = StepPlanner(self.track, self.capture, self.frees, self.counters, self.prune_replays)

    @property
    def tree(self) -> Any:
        """This scheduler's SparseRadixCache (set where the plug-in builds it): replays evict from it."""
        return self.planner.tree

    @tree.setter
    def tree(self, tree: Any) -> None:
        self.planner.tree = tree

    # -- which method serves a request ------------------------------------------------------------
    def admit(self, req: Any) -> SparseRequest:
        """At admission (before the request first enters the waiting queue): make its record (on its handle,
        :data:`sgl_sparse.request.HANDLE`), resolve its method and its own prune and, when its method is not the
        server's config, move it into that config's prefix-tree namespace through ``extra_key`` (which every stock
        match and insert of SGLang reads). Idempotent (a retracted request comes back)."""
        rec = record_of(req)
        if rec is not None:
            return rec
        served, prune = self._default, None
        if self.resolver is not None:
            custom_params = getattr(req.sampling_params, "custom_params", None)
            try:
                served = self.resolver.resolve(custom_params)
                if isinstance(custom_params, dict) and PRUNE_KEY in custom_params:
                    spec = parse_prune_param(custom_params[PRUNE_KEY], len(req.origin_input_ids))
                    if (why := prune_problem(self.resolver, spec)) is not None:
                        raise RequestMethodError(PRUNE_KEY, why)
                    prune = spec
            except RequestMethodError as e:
                # The HTTP process validates every request first; this is a request that bypassed it.
                req.set_finish_with_abort(f"custom_params.{e.key}: {e}")
        if (why := multimodal_replay_problem(req, served.method, prune)) is not None:
            req.set_finish_with_abort(why)
        # A match before admission (an SGLang path that skips the queue hook) left its view on the request.
        rec = SparseRequest(req.rid, served, prune, view=match_view(req))
        attach(req, rec)
        if served.fingerprint != self.fingerprint:
            ns = f"sgl_sparse={served.fingerprint}"
            req.extra_key = ns if not req.extra_key else f"{ns}:{req.extra_key}"
        return rec

    def record(self, req: Any) -> SparseRequest:
        """``req``'s record (made now if it was never admitted)."""
        rec = record_of(req)
        return rec if rec is not None else self.admit(req)

    def served(self, req: Any) -> Served:
        return self.record(req).served

    def window_for(self, req: Any) -> int:
        """The prompt's last queries ``req``'s final prefill reads: its method's observation window and, where its
        own prune scores the ranges with the prompt's last queries (snapkv_global; knorm reads keys only, but one
        window for both keeps this simple), at least SnapKV's; the method is handed only its own
        (``StepPlanner._window``). The tree leaves these positions to be computed on a dense prefix hit
        (``SparseRadixCache.window_for``)."""
        rec = self.record(req)
        window = rec.method.observation_window()
        spec = rec.prune
        if spec is not None and spec.needs_window:
            window = max(window, SNAPKV_WINDOW)
        return window

    def evicts_for(self, req: Any) -> bool:
        """Whether ``req``'s method evicts, or it prunes its own prompt (either way the tree defers its insertion
        to finish and keeps its holes)."""
        rec = self.record(req)
        return rec.method.evicts or rec.prune is not None

    def requests_by_method(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tracked.values():
            out[t.method.name] = out.get(t.method.name, 0) + 1
        return out

    # -- request states ------------------------------------------------------------------------
    def track(self, req: Any) -> SparseRequest:
        """The request's record, its run started at its first forward step: its method's state from its match
        view, its row, its window capture."""
        rec = record_of(req)
        if rec is not None and rec.state is not None:  # every step after its first
            return rec
        rec = self.record(req)
        method = rec.method
        st = method.new_state(req.rid)
        n_prefix = len(req.prefix_indices)
        view = rec.view
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
        rec.start(st, int(req.req_pool_idx))
        self.tracked[req.rid] = rec
        window = self.window_for(req)
        if window > 0:
            self.capture.start(rec, window, method.observation_window() > 0 and method.observes_decode())
        return rec

    def finish(self, req: Any) -> Any:
        """The request finished, was aborted or retracted (tree callback): its kept set and payload for
        the tree; its record drops what its run held."""
        from sgl_sparse.radix.records import FinishedState

        self.tracked.pop(req.rid, None)
        rec = record_of(req)
        if rec is None:
            return None
        self.capture.drop(rec)
        st = rec.state
        if st is None:
            return None
        payload = rec.method.on_finish(st)
        done = FinishedState(kept=st.kept, payload=payload, tail_start=st.tail_start,
                             evict_branches_after=rec.evict_branches_after, pruned=rec.pruned,
                             sparse_from=st.sparse_from, logical_len=st.logical_len)
        rec.stop()
        return done

    @staticmethod
    def kv_slots_used(allocator: Any) -> int:
        """Physical slots not free: held by running requests or by the prefix tree."""
        return int(allocator.size - allocator.available_size())

    def logical_tokens_running(self) -> int:
        return sum(t.running_state.logical_len for t in self.tracked.values())

    def kept_tokens_running(self) -> int:
        return sum(t.running_state.num_kept for t in self.tracked.values())

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
            self._bind_static(batch)
            return
        if not self.evicting or not mode.is_decode():
            return
        with no_host_sync():
            self._before_decode(batch, model_runner)
            self._bind_static(batch)

    def _bind_static(self, batch: Any) -> None:
        """A static selector's rows get what the step's requests' states hand it (PyramidKV's layer sets), before
        the forward (eager or a graph replay) reads them."""
        sel = self.method.selector
        if sel is None or not sel.static:
            return
        states: list[RequestState | None] = []
        rows: list[int] = []
        for req in batch.reqs:
            if req.req_pool_idx is None:
                continue
            rec = record_of(req)
            states.append(rec.state if rec is not None else None)
            rows.append(int(req.req_pool_idx))
        sel.bind(states, rows)

    def _before_decode(self, batch: Any, model_runner: Any) -> None:
        lens = []
        for req in batch.reqs:
            rec = record_of(req)
            if rec is None or rec.state is None:
                return
            lens.append(rec.state.num_kept + 1)  # the retained set plus this step's token
        self.decode_live_lens = torch.tensor(lens, dtype=torch.int32)
        self.tables.set_decode(model_runner.req_to_token_pool.req_to_token, batch.req_pool_indices,
                               self.decode_live_lens, batch.seq_lens_cpu.tolist() if self.tables.check else [])

    def _before_prefill(self, batch: Any) -> None:
        seq_lens = batch.seq_lens_cpu.tolist()
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.req_pool_idx is None:
                continue
            rec = self.track(req)
            if rec.prompt_done:
                continue  # a decode token inside a mixed step
            st = rec.running_state
            total = len(req.origin_input_ids) + len(req.output_ids)
            rec.method.on_prefill_chunk(st, PrefillChunk(st.logical_len, int(seq_lens[i]), total))

    def after_forward(self, batch: Any, model_runner: Any, result: Any = None) -> None:
        self.decode_live_lens = None
        with no_host_sync():
            self.tables.done()
        if self.active and batch is not None and batch.reqs:
            with no_host_sync(batch.forward_mode.is_decode()):
                self.deferred = self.planner.run(batch, model_runner, result)
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
            self.planner.run_deferred(d)
        if d.stream is not None and hand_frees:
            self.frees.flush_on_current_stream()
        if self.metrics is not None:
            self.metrics.update(self, d.model_runner.token_to_kv_pool_allocator)


_runtime: SparseRuntime | None = None


def prune_replay_config(prompts: dict[str, Any] | None) -> Any:
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
        resolver = handoff.resolver()
        method = resolver.default.method
        _runtime = SparseRuntime(method=method, fingerprint=method.config.fingerprint(), resolver=resolver,
                                 prune_replays=prune_replay_config(handoff.read().replay_prompts))
    return _runtime
