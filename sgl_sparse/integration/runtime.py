"""Process-wide runtime of a scheduler process: the method, per-request states, the eviction step.

Scheduler, tree and model runner share one process (per TP rank), so module state is the natural
place for what they share. The attention backend reaches a request's state through
``ForwardBatch.rids``; the step hooks through ``ScheduleBatch.reqs``.

The truth about which positions a request retains is its ``req_to_token`` row: a position holds a
slot, or ``SENTINEL_SLOT`` once evicted. The runtime keeps the same set on the host
(``RequestState.kept``, from the tree's match view at admission and from every plan it applies), so
the per-step decision, the plan checks and the graph-decode plan lengths need no device sync. Jobs:

* :mod:`.capture` - window queries of observing methods;
* :mod:`.frees` - slots freed by eviction, ordered against the schedule stream;
* this module - states, the after-forward step (observe, plan, one batched apply per step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.contract import (
    ObservationWindow,
    PrefillChunk,
    RequestState,
    SparseMethod,
    StepInfo,
    check_keep_plan,
    served_hooks_problem,
)
from sgl_sparse.integration import handoff
from sgl_sparse.integration.capture import QueryCapture
from sgl_sparse.integration.frees import PendingFrees
from sgl_sparse.integration.tables import DeviceTables
from sgl_sparse.registry import create_method
from sgl_sparse.slots import SENTINEL_SLOT, retained_positions, to_device

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    evicted_tokens_total: int = 0
    chain_hits_total: int = 0
    chain_hit_tokens_total: int = 0  # logical tokens of the matched prefixes (what cached_tokens counts)
    chain_hit_kept_tokens_total: int = 0  # of them, with resident KV (physical)
    eviction_steps_total: int = 0


@dataclass
class Tracked:
    """A request the runtime follows: the method's state plus what the step needs about it."""

    state: RequestState
    pool_idx: int
    prompt_done: bool = False


@dataclass
class SparseRuntime:
    method: SparseMethod[Any]
    fingerprint: str
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

    # Whether any per-request work is needed (dense: none, the stock path runs untouched); fixed.
    active: bool = field(init=False)

    def __post_init__(self) -> None:
        m = self.method
        if (why := served_hooks_problem(m)) is not None:
            raise ValueError(f"sgl_sparse: {why}")
        self.active = m.evicts or m.observation_window() > 0 or m.needs_layer_hooks
        self.capture = QueryCapture(m.observation_window(), m.observes_decode())

    @property
    def states(self) -> dict[str, RequestState]:
        return {rid: t.state for rid, t in self.tracked.items()}

    # -- request states ------------------------------------------------------------------------
    def track(self, req: Any) -> Tracked:
        """The request's record, created at its first forward step from its match view (admission)."""
        t = self.tracked.get(req.rid)
        if t is not None:
            return t
        from sgl_sparse.radix.tree import VIEW_ATTR

        st = self.method.new_state(req.rid)
        n_prefix = len(req.prefix_indices)
        view = getattr(req, VIEW_ATTR, None)
        if n_prefix:
            record = None
            if view is not None and view.length == n_prefix:
                st.set_kept(view.kept, logical_len=n_prefix)
                record = view.record
            elif self.method.evicts:
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
            self.method.restore_state(st, record.payload if record is not None else None)
        t = Tracked(st, int(req.req_pool_idx))
        self.tracked[req.rid] = t
        return t

    def finish(self, req: Any) -> Any:
        """The request finished, was aborted or retracted (tree callback): its kept set and payload for
        the tree; drops every per-request structure."""
        from sgl_sparse.radix.tree import FinishedState

        self.capture.drop(req.rid)
        t = self.tracked.pop(req.rid, None)
        if t is None:
            return None
        payload = self.method.on_finish(t.state)
        return FinishedState(kept=t.state.kept, payload=payload)

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
        self.decode_live_lens = None
        self.tables.done()
        if not self.active or batch is None or not batch.reqs:
            return
        mode = batch.forward_mode
        if mode.is_extend():
            self._before_prefill(batch)
            return
        if not self.method.evicts or not mode.is_decode():
            return
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
            self.method.on_prefill_chunk(t.state, PrefillChunk(t.state.logical_len, int(seq_lens[i]), total))

    def after_forward(self, batch: Any, model_runner: Any) -> None:
        self.decode_live_lens = None
        self.tables.done()
        self._evict_step(batch, model_runner)
        if self.metrics is not None:
            self.metrics.update(self, model_runner.token_to_kv_pool_allocator)

    def _evict_step(self, batch: Any, model_runner: Any) -> None:
        if not self.active or batch is None or not batch.reqs:
            return
        mode = batch.forward_mode
        if not (mode.is_extend() or mode.is_decode()):
            return
        seq_lens = batch.seq_lens_cpu.tolist()
        plans: list[tuple[Any, Tracked, torch.Tensor]] = []
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.req_pool_idx is None:
                continue
            t = self.track(req)
            st = t.state
            seq_len = int(seq_lens[i])
            new_tokens = seq_len - st.logical_len
            if new_tokens <= 0:
                continue
            st.advance(new_tokens)
            # Per request, not per batch: a mixed step (--enable-mixed-chunk) carries prefill chunks
            # and decode tokens of requests whose prompt is long done.
            is_prefill = not t.prompt_done
            final = is_prefill and seq_len >= len(req.origin_input_ids) + len(req.output_ids)
            step = StepInfo(is_prefill, new_tokens, max(0, seq_len - len(req.origin_input_ids)),
                            final_prefill=final)
            if self.capture.window > 0 and self.method.wants_observation(st, step):
                if not is_prefill and not self.capture.observes_decode:
                    raise RuntimeError(f"sgl_sparse: {self.method.name}.wants_observation is true in decode but "
                                       "observes_decode() is false, so no decode queries were captured")
                self.method.on_observation(st, self._window(req, st, model_runner))
            if final:
                t.prompt_done = True
                self.capture.prompt_done(req.rid)
            plan = self.method.on_step_end(st, step)
            if plan is not None:
                keep = check_keep_plan(self.method, plan, st.kept)
                if keep.numel() < st.num_kept:
                    plans.append((req, t, keep))
        if plans:
            self._apply(plans, model_runner)

    def _window(self, req: Any, st: RequestState, model_runner: Any) -> ObservationWindow:
        queries = self.capture.get(req.rid)
        n_layers = self.capture.num_layers
        if not queries or len(queries) != n_layers:
            raise RuntimeError(f"sgl_sparse: {self.method.name} needs the last queries of every layer, but the "
                               f"attention backend captured {len(queries)} layer(s) for request {req.rid} "
                               "(a CUDA graph around attention skips the capture; see docs/architecture.md)")
        n_w = queries[0].shape[0]
        row = model_runner.req_to_token_pool.req_to_token[req.req_pool_idx]
        slots = row[to_device(st.kept, row.device)].long()
        # The pool's key buffers and the request's slots: the scoring kernel reads keys in place.
        return ObservationWindow(queries=queries, q_pos=torch.arange(st.logical_len - n_w, st.logical_len),
                                 key_buffer=model_runner.token_to_kv_pool.get_key_buffer, key_rows=slots,
                                 k_pos=st.kept, num_layers=n_layers, scale=float(self.capture.scale or 1.0))

    def _apply(self, plans: list[tuple[Any, Tracked, torch.Tensor]], model_runner: Any) -> None:
        """Apply this step's plans at once: gather the slots to free, write the sentinels, free.

        Host-side index lists (sizes known on the host), one gather and one scatter over
        ``req_to_token`` for the whole step, no device sync. Only request-owned positions
        (``>= cache_protected_len``) are freed; tree-owned ones are hidden in the row."""
        req_to_token = model_runner.req_to_token_pool.req_to_token
        rows, pos, own_rows, own_pos = [], [], [], []
        for req, t, keep in plans:
            st = t.state
            kept = st.kept
            drop = kept[~torch.isin(kept, keep)]
            owned = drop[drop >= req.cache_protected_len]
            rows.append(torch.full((drop.numel(),), t.pool_idx, dtype=torch.int64))
            pos.append(drop)
            own_rows.append(torch.full((owned.numel(),), t.pool_idx, dtype=torch.int64))
            own_pos.append(owned)
            logger.debug("sgl_sparse: %s evicted %d of %d logical (kept %d, protected %d)", req.rid, drop.numel(),
                         st.logical_len, keep.numel(), req.cache_protected_len)
            st.set_kept(keep)
            self.counters.evicted_tokens_total += int(drop.numel())
            self.counters.eviction_steps_total += 1
        device = req_to_token.device
        rows_d, pos_d = to_device(torch.cat(rows), device), to_device(torch.cat(pos), device)
        own_rows_d, own_pos_d = to_device(torch.cat(own_rows), device), to_device(torch.cat(own_pos), device)
        freed = req_to_token[own_rows_d, own_pos_d].long()  # before the sentinels overwrite them
        req_to_token[rows_d, pos_d] = SENTINEL_SLOT
        # Ordered against the schedule stream even when nothing is freed: its next writes to a reused
        # row (and the tree's reads of these rows) must come after the sentinel scatter.
        self.frees.after_writes(model_runner.token_to_kv_pool_allocator, freed)


_runtime: SparseRuntime | None = None


def get_runtime() -> SparseRuntime:
    """Build (first call) or return this process's runtime. Config errors raise here, loudly."""
    global _runtime
    if _runtime is None:
        h = handoff.read()
        method = create_method(h.method, h.config)
        _runtime = SparseRuntime(method=method, fingerprint=method.config.fingerprint())
    return _runtime
