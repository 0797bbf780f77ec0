"""Process-wide runtime of a scheduler process: the method, per-request states, eviction step.

Scheduler, tree and model runner share one process (per TP rank), so module state is the natural
place for what they share. The attention backend reaches a request's state through
``ForwardBatch.rids`` (attributes attached to a ForwardBatch are dropped before the backend sees it);
the after-forward hook through ``ScheduleBatch.reqs``.

The truth about which positions a request retains is its ``req_to_token`` row: a position holds a
slot, or ``SENTINEL_SLOT`` once evicted. The runtime keeps counters beside it so that the per-step
decision (evict now or not) needs no device sync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.contract import ObservationWindow, RequestState, SparseMethod, StepInfo
from sgl_sparse.integration import SENTINEL_SLOT, handoff
from sgl_sparse.registry import create_method

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    evicted_tokens_total: int = 0
    chain_hits_total: int = 0
    chain_hit_tokens_total: int = 0
    eviction_steps_total: int = 0


@dataclass
class SparseRuntime:
    method: SparseMethod[Any]
    fingerprint: str
    states: dict[str, RequestState] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    # rid -> layer -> last ``w`` post-RoPE queries [n, H, D] (methods with an observation window)
    window_q: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    scale: float | None = None
    num_layers: int = 0
    serving: bool = False  # set when our tree is built: this scheduler serves through sgl_sparse
    metrics: Any = None  # SparseMetrics with --enable-metrics

    # Whether any per-request work is needed (dense: none, the stock path runs untouched); fixed.
    active: bool = field(init=False)

    def __post_init__(self) -> None:
        m = self.method
        self.active = m.evicts or m.observation_window() > 0 or m.needs_layer_hooks

    # -- request states ------------------------------------------------------------------------
    def state_for(self, req: Any, req_to_token: torch.Tensor) -> RequestState:
        st = self.states.get(req.rid)
        if st is None:
            st = self.method.new_state(req.rid)
            prefix = req.prefix_indices
            st.logical_len = len(prefix)
            if len(prefix):
                live = int((prefix != SENTINEL_SLOT).sum().item())
                st.num_kept = live
                if live < len(prefix):
                    self.counters.chain_hits_total += 1
                    self.counters.chain_hit_tokens_total += len(prefix)
                self.method.restore_state(st, None)
            row_idx = req.req_pool_idx  # fixed while the state lives (retraction drops the state)
            st.kept_loader = lambda: _retained(req_to_token[row_idx, : st.logical_len])
            self.states[req.rid] = st
        return st

    def drop(self, req: Any) -> None:
        st = self.states.pop(req.rid, None)
        self.window_q.pop(req.rid, None)
        if st is not None:
            self.method.on_finish(st)

    @staticmethod
    def kv_slots_used(allocator: Any) -> int:
        """Physical slots not free: held by running requests or by the prefix tree."""
        return int(allocator.size - allocator.available_size())

    def logical_tokens_running(self) -> int:
        return sum(s.logical_len for s in self.states.values())

    def kept_tokens_running(self) -> int:
        return sum(s.num_kept for s in self.states.values())

    # -- attention-side capture ------------------------------------------------------------------
    def capture_queries(self, layer_id: int, q: torch.Tensor, rids: list[str], q_lens: list[int],
                        scale: float) -> None:
        w = self.method.observation_window()
        if w <= 0:
            return
        self.scale = scale
        self.num_layers = max(self.num_layers, layer_id + 1)
        start = 0
        for rid, n in zip(rids, q_lens):
            q_req = q[start:start + n]
            start += n
            per_layer = self.window_q.setdefault(rid, {})
            prev = per_layer.get(layer_id)
            cat = q_req if prev is None else torch.cat([prev, q_req])
            per_layer[layer_id] = cat[-w:].clone()

    # -- after the forward step ------------------------------------------------------------------
    def after_forward(self, batch: Any, model_runner: Any) -> None:
        self._evict_step(batch, model_runner)
        if self.metrics is not None:
            self.metrics.update(self, model_runner.token_to_kv_pool_allocator)

    def _evict_step(self, batch: Any, model_runner: Any) -> None:
        if not self.active or batch is None or not batch.reqs:
            return
        mode = batch.forward_mode
        if not (mode.is_extend() or mode.is_decode()):
            return
        is_prefill = mode.is_extend()
        req_to_token = model_runner.req_to_token_pool.req_to_token
        seq_lens = batch.seq_lens_cpu.tolist()
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.req_pool_idx is None:
                continue
            st = self.state_for(req, req_to_token)
            seq_len = int(seq_lens[i])
            new_tokens = seq_len - st.logical_len
            if new_tokens <= 0:
                continue
            st.advance(new_tokens)
            final = is_prefill and seq_len >= len(req.origin_input_ids) + len(req.output_ids)
            step = StepInfo(is_prefill, new_tokens, max(0, seq_len - len(req.origin_input_ids)),
                            final_prefill=final)
            if self.method.observation_window() > 0 and self.method.wants_observation(st, step):
                self.method.on_observation(st, self._window(req, st, model_runner))
            plan = self.method.on_step_end(st, step)
            if plan is not None:
                self._apply(req, st, plan.keep, model_runner)

    def _window(self, req: Any, st: RequestState, model_runner: Any) -> ObservationWindow:
        queries = self.window_q.get(req.rid, {})
        if len(queries) != self.num_layers or not queries:
            raise RuntimeError(f"sgl_sparse: {self.method.name} needs the last queries of every layer, but the "
                               f"attention backend captured {len(queries)} layer(s) for request {req.rid} "
                               "(a CUDA graph around attention skips the capture; see docs/architecture.md)")
        n_w = queries[0].shape[0]
        row = model_runner.req_to_token_pool.req_to_token[req.req_pool_idx, : st.logical_len]
        positions = _retained(row).to(row.device)
        slots = row[positions].long()
        kv_pool = model_runner.token_to_kv_pool

        def keys(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return kv_pool.get_key_buffer(layer)[slots], positions

        return ObservationWindow(queries=queries, q_pos=torch.arange(st.logical_len - n_w, st.logical_len),
                                 keys=keys, num_layers=self.num_layers, scale=float(self.scale or 1.0))

    def _apply(self, req: Any, st: RequestState, keep: torch.Tensor, model_runner: Any) -> None:
        """Free the request-owned retained slots not in ``keep``; hide tree-owned ones."""
        row = model_runner.req_to_token_pool.req_to_token[req.req_pool_idx]
        n = st.logical_len
        device = row.device
        keep_dev = keep.to(device)
        if keep.numel() and (int(keep.max()) >= n or bool((row[keep_dev] == SENTINEL_SLOT).any())):
            raise RuntimeError(f"{self.method.name}: KeepPlan keeps positions that are not retained")
        drop = row[:n] != SENTINEL_SLOT
        drop[keep_dev] = False
        owned = drop.clone()
        owned[: req.cache_protected_len] = False
        freed = row[:n][owned].long()
        if freed.numel():
            model_runner.token_to_kv_pool_allocator.free(freed)
        dropped = int(drop.sum().item())
        row[:n][drop] = SENTINEL_SLOT
        st.set_kept(keep.cpu())
        logger.debug("sgl_sparse: %s evicted %d of %d logical (kept %d, protected %d)", req.rid, dropped, n,
                     st.num_kept, req.cache_protected_len)
        self.counters.evicted_tokens_total += dropped
        self.counters.eviction_steps_total += 1


def _retained(row: torch.Tensor) -> torch.Tensor:
    return (row != SENTINEL_SLOT).nonzero().flatten().cpu()


_runtime: SparseRuntime | None = None


def get_runtime() -> SparseRuntime:
    """Build (first call) or return this process's runtime. Config errors raise here, loudly."""
    global _runtime
    if _runtime is None:
        h = handoff.read()
        method = create_method(h.method, h.config)
        _runtime = SparseRuntime(method=method, fingerprint=method.config.fingerprint())
    return _runtime
