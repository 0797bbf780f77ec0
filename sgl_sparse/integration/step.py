"""The after-forward step of an evicting or observing method: per request, advance the host
counters, apply its own prune once its prompt is complete (``on_prune``, then freed at once), hand the
method its observation window (SnapKV), take its plan and check it (the same ``check_keep_plan`` as the
reference driver); then apply every plan of the step at once.

Per request, not per batch: a mixed step (``--enable-mixed-chunk``) carries prefill chunks and decode
tokens of requests whose prompt is long done. The apply is one gather of the slots to free and one
sentinel scatter over ``req_to_token`` for the whole step, from host-side index lists (sizes known on
the host), no device sync; the frees are ordered against the schedule stream by :mod:`.frees`.

A decode token's step runs once SGLang has processed the previous forward's results (:meth:`StepPlanner.run` defers it,
the runtime runs it from around ``Scheduler.process_batch_result``), before the next forward: SGLang's overlap
scheduler (its default) launches a decode forward before it knows which requests the previous one finished, so
the step must not see a finished request. Without overlap the deferred step runs just before its own results
are processed, where it always ran.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import ObservationWindow, StepInfo
from sgl_sparse.integration import replay
from sgl_sparse.integration.capture import QueryCapture
from sgl_sparse.integration.frees import PendingFrees
from sgl_sparse.integration.metrics import Counters
from sgl_sparse.integration.syncs import allow_host_sync
from sgl_sparse.integration.tp import TP_CHECK, check_ranks_agree, scores_all_reduce, scores_max_over_ranks
from sgl_sparse.prune.keep import ReplayInputs, own_prune
from sgl_sparse.prune.spec import KVZIP_GLOBAL, SNAPKV_WINDOW, PruneSpec
from sgl_sparse.request import PRUNE_REPORT, SparseRequest, record_of
from sgl_sparse.rules import check_keep_plan
from sgl_sparse.slots import to_device, write_sentinels

logger = logging.getLogger(__name__)


@dataclass
class Deferred:
    """The decode tokens of a forward whose step waits until SGLang has processed the previous forward's
    results (module doc): the requests and their sequence lengths as the forward saw them, the forward's result
    object (to tell which result processing is its own) and its CUDA stream (None on CPU)."""

    entries: list[tuple[Any, int]]
    model_runner: Any
    result: Any
    stream: Any
    decode: bool  # a decode batch (not a mixed one): run under the host-sync check


class StepPlanner:
    """The runtime's after-forward step (module doc). ``start(req)``: the request's record, its run started at its
    first forward step (``SparseRuntime.track``); ``prune_replays``: the ``kvzip`` config a request's own
    ``kvzip_global`` prune replays with (None: not served here); ``tree``: the prefix tree, whose evictable slots
    a replay may take (set when the plug-in builds it)."""

    def __init__(self, start: Callable[[Any], SparseRequest], capture: QueryCapture, frees: PendingFrees,
                 counters: Counters, prune_replays: Any = None) -> None:
        self._start = start
        self.capture = capture
        self.frees = frees
        self.counters = counters
        self.prune_replays = prune_replays
        self.tree: Any = None

    def run(self, batch: Any, model_runner: Any, result: Any = None) -> Deferred | None:
        """The step after ``batch``'s forward: prefill chunks at once; decode tokens (requests whose prompt is
        complete) returned as a :class:`Deferred` for :meth:`run_deferred`, which the runtime calls once SGLang
        has processed the previous forward's results. Under overlap scheduling a decode forward is launched before
        the previous one's tokens are checked, so a request that finished there is still in its batch: the forward
        wrote K/V for its last token, but no step of a finished request may observe or evict (its record is what
        the next turn resumes from, and it would depend on whether another request's prefill took that
        iteration)."""
        mode = batch.forward_mode
        if not (mode.is_extend() or mode.is_decode()):
            return None
        now: list[tuple[Any, int]] = []
        later: list[tuple[Any, int]] = []
        for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu.tolist(), strict=True):
            if req.is_retracted or req.req_pool_idx is None:
                continue
            rec = record_of(req)
            (later if rec is not None and rec.prompt_done else now).append((req, int(seq_len)))
        if now:
            self._run(batch, now, model_runner)
        if not later:
            return None
        stream = torch.cuda.current_stream() if _on_cuda(model_runner) else None
        # Not the batch: SGLang goes on changing it (the running batch), and only a final prefill reads it.
        return Deferred(later, model_runner, result, stream, bool(mode.is_decode()))

    def run_deferred(self, d: Deferred) -> None:
        """The deferred decode tokens' step, after SGLang processed the results before them: a request finished
        (or retracted, or released) meanwhile is skipped, as without overlap scheduling, where that forward never
        runs. Its GPU work goes on the forward's stream, after that forward and before the next."""
        entries = [(req, n) for req, n in d.entries
                   if not (req.finished() or req.is_retracted or req.req_pool_idx is None) and _started(req)]
        if not entries:
            return
        with torch.cuda.stream(d.stream) if d.stream is not None else contextlib.nullcontext():
            self._run(None, entries, d.model_runner)  # decode tokens only: no final prefill reads the batch

    def _run(self, batch: Any, entries: list[tuple[Any, int]], model_runner: Any) -> None:
        """Every request's observation and plan, then all plans applied at once."""
        plans: list[tuple[Any, SparseRequest, torch.Tensor]] = []
        pruned: list[torch.Tensor] = []  # the retained sets its own prunes left, for the TP check
        max_over_ranks = scores_max_over_ranks()
        for req, seq_len in entries:
            rec = self._start(req)
            st = rec.running_state
            new_tokens = seq_len - st.logical_len
            if new_tokens <= 0:
                continue
            st.advance(new_tokens)
            is_prefill = not rec.prompt_done
            final = is_prefill and seq_len >= len(req.origin_input_ids) + len(req.output_ids)
            method = rec.method
            ids = functools.partial(_token_ids, req) if method.needs_token_ids() else None
            info = StepInfo(is_prefill, new_tokens, max(0, seq_len - len(req.origin_input_ids)),
                            final_prefill=final, token_ids=ids, max_over_ranks=max_over_ranks)
            if final and rec.prune is not None:
                if (left := self._prune(batch, req, rec, rec.prune, model_runner)) is not None:
                    pruned.append(left)
            if final and method.runs_replays:
                room = replay.room(model_runner, st.logical_len, self.tree)
                replays = method.replays(st, info, room.context)
                if replays and max(len(r.token_ids) for r in replays) > room.memory:
                    self._memory_bound(req, method.name, room)
                    replays = method.replays(st, info, room.tokens)  # the contract: the last plan runs
                if replays:
                    replay.run(self.tree, batch, req, st, method, replays, model_runner)
            observes = method.observation_window() > 0 and method.wants_observation(st, info)
            # A step that scores a window may copy its scores to the host once (the keep is chosen there): the one
            # sync a scoring method's step is allowed, every ``window``/``evict_interval`` decode tokens; every other
            # decode step stays under the check.
            with allow_host_sync() if observes else contextlib.nullcontext():
                if observes:
                    if not is_prefill and not self.capture.observes_decode(rec):
                        raise RuntimeError(f"sgl_sparse: {method.name}.wants_observation is true in decode but "
                                           "observes_decode() is false, so no decode queries were captured")
                    method.on_observation(st, self._window(req, rec, model_runner, method.observation_window()))
                if final:
                    rec.prompt_done = True
                    self.capture.prompt_done(rec)
                plan = method.on_step_end(st, info)
            if plan is not None and (keep := check_keep_plan(method, plan, st.kept)).numel() < st.num_kept:
                plans.append((req, rec, keep))
        if TP_CHECK:  # a scored keep's choice as much as a method's plan
            check_ranks_agree([*pruned, *(keep for _, _, keep in plans)])
        if plans:
            self._apply(plans, model_runner)

    def _memory_bound(self, req: Any, who: str, room: replay.Room) -> None:
        """A replay plan cut to KV memory rather than the context: its chunks are shorter than on an idle server,
        so its kept set may differ. Counted and logged, not hidden."""
        self.counters.replay_room_memory_bound_total += 1
        logger.warning("sgl_sparse: %s: request %s: replays cut to %d tokens by KV memory (free and "
                       "tree-evictable slots; the context allows %d)", who, req.rid, room.tokens, room.context)

    def _prune_room(self, req: Any, model_runner: Any, logical_len: int) -> int:
        """The room of a ``kvzip_global`` prune's replays (their longest: a chunk plus the instructions)."""
        room = replay.room(model_runner, logical_len, self.tree)
        cfg = self.prune_replays
        if room.memory < min(room.context, cfg.chunk_size + cfg.overhead):
            self._memory_bound(req, KVZIP_GLOBAL, room)
        return room.tokens

    def _prune(self, batch: Any, req: Any, rec: SparseRequest, spec: PruneSpec,
               model_runner: Any) -> torch.Tensor | None:
        """The request's own prune (custom_params sgl_sparse_prune), in the step that completed its prompt, after
        the forward (its prompt attended the ranges) and before its method replays, observes or plans (nothing
        after it does): the method is told which retained positions leave (``on_prune``), then they are freed at
        once, so the replays' rows, the observation window and the plan check all see the rest, and the tree
        stores the sequence without them. Positions already gone (an earlier turn's eviction) are not handed
        over. A scored keep keeps the ``keep_tokens`` of the ranges' retained positions its policy scores highest
        (the prompt's last queries over every retained key, summed over the TP group: every rank keeps the same;
        ``kvzip_global``: replay forwards that reconstruct the ranges, their scores' maximum over the TP group).
        The spec comes with the request, identical on every TP rank. Returns the retained positions left (None:
        the prune removed nothing)."""
        st = rec.running_state
        kept = st.kept
        replays = None
        if spec.policy == KVZIP_GLOBAL and self.prune_replays is not None:
            tree = self.tree
            replays = ReplayInputs(
                token_ids=_token_ids(req, 0, st.logical_len), config=self.prune_replays,
                max_tokens=self._prune_room(req, model_runner, st.logical_len),
                run=lambda rs, scorer: replay.run(tree, batch, req, st, scorer, rs, model_runner),
                max_over_ranks=scores_max_over_ranks())
        out = own_prune(kept, spec, lambda: self._window(req, rec, model_runner, SNAPKV_WINDOW), replays)
        _report(req, out.report)
        if out.leave is None:
            # Reported, not hidden: the request still runs (its prompt is whole), the response says so and
            # /server_info counts it.
            logger.warning("sgl_sparse: request %s: its own prune was not applied: %s", req.rid, out.report["message"])
            self.counters.unscored_prunes_total += 1
            return None
        drop = out.leave
        if not out.pruned:
            return None
        rec.pruned = True
        rec.evict_branches_after = out.evict_branches_after
        rec.method.on_prune(st, kept[drop])
        self._apply([(req, rec, kept[~drop])], model_runner)
        return kept[~drop]

    def _window(self, req: Any, rec: SparseRequest, model_runner: Any, w: int) -> ObservationWindow:
        """The request's last ``w`` captured queries over its retained keys (the capture may hold more: the longer
        of its method's window and its own prune's)."""
        st = rec.running_state
        queries = self.capture.get(rec)
        n_layers = self.capture.num_layers
        if not queries or len(queries) != n_layers:
            raise RuntimeError(f"sgl_sparse: {rec.method.name} needs the last queries of every layer, but the "
                               f"attention backend captured {len(queries)} layer(s) for request {req.rid} "
                               "(a CUDA graph around attention skips the capture; see docs/limits.md)")
        queries = {layer: q[-w:] for layer, q in queries.items()}
        n_w = queries[0].shape[0]
        row = model_runner.req_to_token_pool.req_to_token[req.req_pool_idx]
        slots = row[to_device(st.kept, row.device)].long()
        q_pos = torch.arange(st.logical_len - n_w, st.logical_len)
        scale = float(self.capture.scale or 1.0)
        # TP: this rank's queries and keys are its own heads; the method sums its scores over the group.
        all_reduce = scores_all_reduce()
        store = getattr(model_runner.token_to_kv_pool, "store", None)
        if store is not None:
            # A method-owned layout (a composition): the keys as the store holds them, dequantized per layer, the
            # same keys decode attention will read. A full-precision copy exists for no key a prefix hit or an
            # earlier chunk brought, so the store's is the one view every retained key has.
            return ObservationWindow(queries=queries, q_pos=q_pos,
                                     key_buffer=lambda layer: store.read_keys(layer, slots),
                                     key_rows=torch.arange(slots.numel(), device=slots.device), k_pos=st.kept,
                                     num_layers=n_layers, scale=scale, all_reduce=all_reduce)
        # The pool's key buffers and the request's slots: the scoring kernel reads keys in place.
        return ObservationWindow(queries=queries, q_pos=q_pos,
                                 key_buffer=model_runner.token_to_kv_pool.get_key_buffer, key_rows=slots,
                                 k_pos=st.kept, num_layers=n_layers, scale=scale, all_reduce=all_reduce)

    def _apply(self, plans: list[tuple[Any, SparseRequest, torch.Tensor]], model_runner: Any) -> None:
        """Apply this step's plans at once: gather the slots to free, write the sentinels, free.

        Host-side index lists (sizes known on the host), one gather and one scatter over
        ``req_to_token`` for the whole step, no device sync. Only request-owned positions
        (``>= cache_protected_len``) are freed; tree-owned ones are hidden in the row."""
        req_to_token = model_runner.req_to_token_pool.req_to_token
        rows, pos, own_rows, own_pos = [], [], [], []
        for req, rec, keep in plans:
            st = rec.running_state
            kept = st.kept
            drop = kept[~torch.isin(kept, keep)]
            owned = drop[drop >= req.cache_protected_len]
            rows.append(torch.full((drop.numel(),), rec.pool_idx, dtype=torch.int64))
            pos.append(drop)
            own_rows.append(torch.full((owned.numel(),), rec.pool_idx, dtype=torch.int64))
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
        write_sentinels(req_to_token, (rows_d, pos_d))
        # Ordered against the schedule stream even when nothing is freed: its next writes to a reused
        # row (and the tree's reads of these rows) must come after the sentinel scatter.
        self.frees.after_writes(model_runner.token_to_kv_pool_allocator, freed)


def _on_cuda(model_runner: Any) -> bool:
    return str(getattr(model_runner, "device", "cpu")).startswith("cuda") and torch.cuda.is_available()


def _started(req: Any) -> bool:
    rec = record_of(req)
    return rec is not None and rec.started


def _token_ids(req: Any, start: int, end: int) -> Sequence[int]:
    """The ids known at logical positions ``[start, end)`` of ``origin_input_ids + output_ids``, without
    building the concatenation: a prefix of them, since under overlap scheduling the token a decode forward
    wrote is appended to ``output_ids`` only after the next forward (``StepInfo.token_ids``)."""
    n_in = len(req.origin_input_ids)
    return [*req.origin_input_ids[start:min(end, n_in)], *req.output_ids[max(0, start - n_in):max(0, end - n_in)]]


def _report(req: Any, report: dict[str, Any]) -> None:
    """The outcome of a request's own prune, for its response (``meta_info["sgl_sparse"]["prune"]``, moved there by
    the HTTP process: :func:`.per_request.around_wait_one_response`). Sent as SGLang's per-token ``customized_info``
    (the one channel from the scheduler to a response): a list whose first entry goes with the first output token,
    which this step's forward produced."""
    info = dict(req.customized_info or {})
    info[PRUNE_REPORT] = [report]
    req.customized_info = info
