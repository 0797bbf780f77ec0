"""The scored-eviction base (``methods/eviction/base.py``): a method that only scores gets the TP reduction and the
budgeted top-k keep from the base. Checked against a plain-torch reference written here (sink, recent, then the
highest scores, ties to the earlier position), and under a simulated two-rank split of the heads."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import ObservationWindow, RequestState, StepInfo
from sgl_sparse.methods.eviction.base import WINDOW, Budget, ScoredEviction, compacts_now
from sgl_sparse.reference import ToyAttentionStack, run_request

N, LAYERS, HQ, HKV, D, W = 64, 2, 4, 2, 8, 4


@dataclass(frozen=True)
class KeyNormConfig(MethodConfig):
    method_name = "keynorm_test"
    budget: int = 24
    sink_tokens: int = 3
    window_size: int = W
    decode_interval: int = 0


class KeyNorm(ScoredEviction[KeyNormConfig]):
    """A whole scored method: keys with a small norm matter (KNorm). ``mean``: average over this rank's KV heads
    (``head_mean``) instead of summing."""

    name = "keynorm_test"
    config_cls = KeyNormConfig

    def observation_window(self) -> int:
        return self.config.window_size

    def observes_decode(self) -> bool:
        return self.config.decode_interval > 0

    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        return compacts_now(state, step, self.config.budget, self.config.decode_interval)

    def budget(self) -> Budget:
        return Budget(self.config.budget, self.config.sink_tokens, self.config.window_size)

    def score(self, state: RequestState, window: ObservationWindow) -> torch.Tensor:
        norms = [-window.keys(layer)[0].float().norm(dim=-1) for layer in range(window.num_layers)]  # [n, Hkv]
        per_layer = [x.mean(dim=1) if self.head_mean else x.sum(dim=1) for x in norms]
        return torch.stack(per_layer).sum(0)


class KeyNormMean(KeyNorm):
    head_mean = True


def reference_keep(positions: list[int], scores: list[float], budget: int, sink: int, recent: int) -> list[int]:
    """Plain Python: the first ``sink``, the last ``recent``, the best-scored of the rest (ties: earlier first)."""
    n = len(positions)
    if n <= budget:
        return positions
    middle = list(range(sink, n - recent))
    best = sorted(middle, key=lambda i: (-scores[i], i))[:budget - sink - recent]
    return [positions[i] for i in sorted([*range(sink), *best, *range(n - recent, n)])]


def _window(keys: list[torch.Tensor], k_pos: torch.Tensor, all_reduce: object = None) -> ObservationWindow:
    g = torch.Generator().manual_seed(7)
    queries = {layer: torch.randn(W, HQ * keys[0].shape[1] // HKV, D, generator=g) for layer in range(LAYERS)}
    return ObservationWindow(queries=queries, q_pos=torch.arange(N - W, N), key_buffer=lambda layer: keys[layer],
                             key_rows=k_pos, k_pos=k_pos, num_layers=LAYERS, scale=D**-0.5,
                             all_reduce=all_reduce)  # type: ignore[arg-type]


def _keys(seed: int, ties: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct norms: many exact ties among the candidates
        return [torch.randint(1, 3, (N, HKV, D), generator=g).float() for _ in range(LAYERS)]
    return [torch.randn(N, HKV, D, generator=g) * torch.tensor([0.5, 3.0])[None, :, None] for _ in range(LAYERS)]


def _plan(method: KeyNorm, window: ObservationWindow) -> torch.Tensor:
    state = method.new_state("r")
    state.set_kept(window.k_pos, logical_len=N)
    step = StepInfo(True, N, 0, final_prefill=True)
    assert method.wants_observation(state, step)
    method.on_observation(state, window)
    plan = method.on_step_end(state, step)
    assert WINDOW not in state.extra  # taken by the step's end
    assert plan is not None
    return plan.keep


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ties", [False, True])
def test_keep_is_the_plain_top_k(seed: int, ties: bool) -> None:
    keys = _keys(seed, ties)
    k_pos = torch.cat([torch.arange(0, 20), torch.arange(25, N)])  # an earlier eviction left a hole
    method = KeyNorm(KeyNormConfig())
    scores = sum(-keys[layer][k_pos].norm(dim=-1).sum(1) for layer in range(LAYERS))
    want = reference_keep(k_pos.tolist(), scores.tolist(), 24, 3, W)
    assert _plan(method, _window(keys, k_pos)).tolist() == want
    assert len(want) == 24


def test_a_budget_over_the_retained_set_keeps_everything() -> None:
    method = KeyNorm(KeyNormConfig(budget=N))
    state = method.new_state("r")
    state.advance(N)
    assert not method.wants_observation(state, StepInfo(True, N, 0, final_prefill=True))
    state.extra[WINDOW] = _window(_keys(0), torch.arange(N))
    assert method.on_step_end(state, StepInfo(True, N, 0, final_prefill=True)) is None


@pytest.mark.parametrize("cls", [KeyNorm, KeyNormMean])
def test_two_ranks_keep_what_one_process_keeps(cls: type[KeyNorm]) -> None:
    """Each simulated rank holds one KV head and scores only it; the base's one reduction per window (a sum, or the
    head-weighted mean) makes both keep the single-process set, which the ranks' own heads alone would not."""
    keys = _keys(3)
    k_pos = torch.arange(N)
    whole = _plan(cls(KeyNormConfig()), _window(keys, k_pos))
    shards = [[k[:, h:h + 1].contiguous() for k in keys] for h in range(HKV)]
    local = [_plan(cls(KeyNormConfig()), _window(shard, k_pos)) for shard in shards]
    assert not torch.equal(local[0], local[1])  # the heads disagree: the reduction decides
    # What each rank contributes to the reduction, computed on its own: its all_reduce then adds the peer's.
    sent: list[list[torch.Tensor]] = [[], []]

    def recorder(rank: int) -> object:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            sent[rank].append(t.clone())
            return t.clone()
        return all_reduce

    for rank in range(HKV):
        _plan(cls(KeyNormConfig()), _window(shards[rank], k_pos, recorder(rank)))
    assert [len(s) for s in sent] == [1, 1]  # one collective per scored window, the same on every rank
    for rank in range(HKV):
        kept = _plan(cls(KeyNormConfig()), _window(shards[rank], k_pos, lambda t, r=rank: t + sent[1 - r][0]))
        assert torch.equal(kept, whole), rank


def test_a_scored_method_runs_through_the_reference_driver() -> None:
    """Prompt compaction, then decode compaction every 4 tokens, through the driver's hooks."""
    method = KeyNorm(KeyNormConfig(budget=20, decode_interval=4))
    trace = run_request(method, ToyAttentionStack(), list(range(3, 83)), prompt_len=60, chunk_size=16)
    assert trace.kept_after_step[3] == 20  # the prompt's last chunk
    assert max(trace.kept_after_step[4:]) <= 20 + 4 and WINDOW not in trace.state.extra
    assert trace.state.kept[:3].tolist() == [0, 1, 2]  # the sink
