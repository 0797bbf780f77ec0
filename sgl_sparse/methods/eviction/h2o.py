"""H2O, the Heavy-Hitter Oracle (Zhang et al., 2023, arXiv:2306.14048): keep the tokens that have received
the most attention so far (heavy hitters) plus the most recent ones.

Each retained token carries an accumulated score: the softmax attention it received, summed over query
heads, layers and the queries observed so far. Observed queries are the prompt's last ``window_size``
(SparseEngine's bounded prefill window; earlier prompt queries are not scored, as there) and, when
``evict_interval`` > 0, every decode query: the runtime captures each request's last ``window_size``
queries, and the method scores them before that many new ones have arrived (and before every eviction),
each query once, against the retained keys it attended to (no eviction happens between a query and its
scoring), so decode accumulation is exact, as in H2O's per-step update. The kept set is
``budget - recent`` heavy hitters (highest score among the non-recent tokens, ties to the earlier
position) plus the last ``recent = int(budget * recent_ratio)`` tokens, one set for all layers and
heads (one pool slot holds every layer's K/V; the original keeps one set per head). Compaction runs at
the end of the prompt and, in decode, every ``evict_interval`` decoded tokens once over the budget (the
original evicts at every step; SparseEngine every 1,024), so at most ``budget + evict_interval`` are
retained.

The score table is indexed by retained order (aligned with ``RequestState.kept``, reordered with each
:class:`KeepPlan`) and lives on the keys' device: decode accumulation adds a device tensor (no host
sync); an eviction copies it to the host once, as SnapKV's selection does. Each request accumulates its
own table, as in H2O (one request, one table): the next turn of a conversation resumes the kept set a
turn left (Chain Cache) with every score at zero, and its prompt's window scores the resumed tokens and
its own alike. Why not resume the scores: a turn's table is dominated by the attention its window (the
prompt's last queries) paid to its neighbours, so the turn after keeps the previous turn's end as its heavy
hitters and evicts its own facts (quality-small's 5-turn agent_recall session: 0.04 carried, 0.96 from
zero, QUALITY.md). ``carry_scores`` keeps the old behaviour: a finished request leaves its table in the
prefix tree (:class:`TreePayload`) and a match through the record's end resumes it (a match that stops
short, or one through a turn that evicted nothing, which leaves no record, starts at zero). A request that prunes
its own prompt drops the pruned tokens' entries (:meth:`H2O.on_prune`) before its prompt's window is scored:
the window scores only the tokens left, and the budget counts only them.

Defaults: ``budget`` 8,192 (SparseEngine's H2O decode budget, Table 11; SnapKV's default here),
``recent_ratio`` 0.5 (H2O's ``heavy_ratio`` = ``recent_ratio`` = 0.1 of the prompt: an even split of the
cache, FMInference/H2O ``h2o_hf``), ``window_size`` 128 (SparseEngine's bounded prefill scoring window),
``evict_interval`` 1,024 (SparseEngine's ``decode_eviction_interval``; 0 turns decode scoring and
eviction off, SparseEngine's score-free default decode, which keeps decode CUDA graphs usable on GPU),
``carry_scores`` off (above).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import KeepPlan, ObservationWindow, RequestState, StepInfo, TreePayload
from sgl_sparse.methods.eviction.base import Budget, ScoredEviction, compacts_now, last_queries, observation_scores
from sgl_sparse.registry import register_method
from sgl_sparse.slots import to_device

SCORES, SCORED = "h2o_scores", "h2o_scored"  # state.extra keys: the table, the length it has scored up to


@dataclass(frozen=True)
class H2OConfig(MethodConfig):
    method_name = "h2o"
    budget: int = 8192  # retained tokens, heavy hitters and recent ones
    recent_ratio: float = 0.5  # share of the budget kept as the most recent tokens
    window_size: int = 128  # queries captured per request (prompt end; decode: scored every window_size)
    evict_interval: int = 1024  # decode: compact every N decoded tokens once over budget; 0: prompt only
    carry_scores: bool = False  # Chain Cache: the next turn resumes the table (else it scores from zero)

    @property
    def recent_tokens(self) -> int:
        return int(self.budget * self.recent_ratio)

    def validate(self) -> None:
        self.require(self.budget >= 1, "budget", "must be >= 1")
        self.require(0.0 <= self.recent_ratio <= 1.0, "recent_ratio", "must be in [0, 1]")
        self.require(self.window_size >= 1, "window_size", "must be >= 1")
        self.require(self.evict_interval >= 0, "evict_interval", "must be >= 0")


@register_method
class H2O(ScoredEviction[H2OConfig]):
    """Scores as the base does, but accumulates them: each observation adds its queries' scores (over every head)
    to the request's table, and a compaction keeps by the table."""

    name = "h2o"
    config_cls = H2OConfig

    def observation_window(self) -> int:
        return self.config.window_size

    def observes_decode(self) -> bool:
        return self.config.evict_interval > 0

    def new_state(self, rid: str) -> RequestState:
        st = RequestState(rid=rid)
        st.extra[SCORED] = 0
        return st

    def restore_state(self, state: RequestState, payload: TreePayload | None) -> None:
        state.extra[SCORED] = state.logical_len  # the prefix's queries were scored by the turn that ran them
        scores = payload.data.get(SCORES) if payload is not None and self.config.carry_scores else None
        if scores is not None and scores.numel() == state.num_kept:
            state.extra[SCORES] = scores

    def on_prune(self, state: RequestState, pruned: torch.Tensor) -> None:
        # The table is in retained order (its first entries: the restored prefix's); the pruned tokens' entries
        # go, so it stays aligned with the kept set the runtime sets next.
        scores = state.extra.get(SCORES)
        if scores is None:
            return
        n = min(scores.numel(), state.num_kept)
        stay = ~torch.isin(state.kept[:n], pruned)
        state.extra[SCORES] = scores[:n][to_device(stay, scores.device)]

    def _evicts_now(self, state: RequestState, step: StepInfo) -> bool:
        return compacts_now(state, step, self.config.budget, self.config.evict_interval)

    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        if step.is_prefill:
            # Scores matter later only if decode evicts, or now if the prompt is over budget.
            return step.final_prefill and (self.config.evict_interval > 0 or state.num_kept > self.config.budget)
        if self.config.evict_interval == 0:
            return False
        unscored = state.logical_len - state.extra.get(SCORED, 0)
        return unscored >= self.config.window_size or (unscored > 0 and self._evicts_now(state, step))

    def budget(self) -> Budget:
        return Budget(self.config.budget, 0, self.config.recent_tokens)

    def score(self, state: RequestState, window: ObservationWindow) -> torch.Tensor:
        new = min(window.q_pos.numel(), state.logical_len - state.extra.get(SCORED, 0))  # queries not scored yet
        if new <= 0:
            return torch.zeros(window.k_pos.numel(), dtype=torch.float32, device=window.key_buffer(0).device)
        return observation_scores(last_queries(window, new), 1, "avgpool")

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        scored = self.scores(state)
        if scored is not None:
            # Each observation's increment, summed over every head, joins the table: it holds the sum over all.
            total = scored[1]
            state.extra[SCORES] = _aligned(state.extra.get(SCORES), total.numel(), total.device) + total
            state.extra[SCORED] = state.logical_len
        if not self._evicts_now(state, step):
            return None
        kept = state.kept
        scores = _aligned(state.extra.get(SCORES), kept.numel(), torch.device("cpu"))
        keep = self.keep_set(torch.arange(kept.numel()), scores.float())  # the one host copy per eviction
        state.extra[SCORES] = scores[to_device(keep, scores.device)]  # retained order, as the plan reorders
        return KeepPlan(kept[keep])

    def on_finish(self, state: RequestState) -> TreePayload | None:
        scores = state.extra.get(SCORES)
        if scores is None or not self.config.carry_scores:
            return None
        return TreePayload({SCORES: _aligned(scores, state.num_kept, scores.device)})


def _aligned(scores: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """The score table extended to ``n`` retained tokens: tokens appended since it was last written
    (retained order, so at its end) have received no scored attention yet."""
    if scores is None:
        return torch.zeros(n, dtype=torch.float32, device=device)
    if scores.numel() >= n:
        return scores[:n]
    return torch.cat([scores, scores.new_zeros(n - scores.numel())])
