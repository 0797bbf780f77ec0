"""The lifecycle contract, driven by the plain-torch reference runtime (no server)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sgl_sparse import create_method
from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import (
    Family,
    KeepPlan,
    ObservationWindow,
    PageSelector,
    PrefillChunk,
    RequestState,
    SparseMethod,
    StepInfo,
)
from sgl_sparse.reference import ToyAttentionStack, run_request

N_LAYERS = 3


def dense_reference(model: ToyAttentionStack, tokens: list[int]) -> torch.Tensor:
    """Whole sequence at once, full causal attention: what every chunking must reproduce."""
    h = model.embed[torch.tensor(tokens)]
    pos = torch.arange(len(tokens))
    for layer in range(model.n_layers):
        q, k, v = model.project(layer, h)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        s = s.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf"))
        h = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(len(tokens), -1)
    return h


@dataclass(frozen=True)
class _RecentConfig(MethodConfig):
    method_name = "recent_for_tests"
    budget: int = 8


class _KeepRecent(SparseMethod[_RecentConfig]):
    """Toy eviction: keep the last ``budget`` positions after every step."""

    name = "recent_for_tests"
    family = Family.EVICTION
    config_cls = _RecentConfig
    evicts = True

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        if state.logical_len <= self.config.budget:
            return None
        return KeepPlan(torch.arange(state.logical_len - self.config.budget, state.logical_len))


class _RecordingSelector(PageSelector):
    """Layer 0 observes, layers 1.. select every token; records each call."""

    page_size = 1

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def selects(self, layer_id: int) -> bool:
        return layer_id > 0

    def observes(self, layer_id: int) -> bool:
        return layer_id == 0

    @property
    def pages_per_row(self) -> int:
        return 64

    def on_kv_write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, decode: bool = False) -> None:
        assert k.shape == (loc.shape[0], 2, 16)
        self.calls.append(f"kv{layer_id}")

    def observe(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        assert q.shape == (1, 4, 16) and k_cache.shape[1:] == (2, 16)
        self.calls.append(f"observe{layer_id}")

    def select(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
        self.calls.append(f"select{layer_id}")
        n = int(seq_lens[0])
        return torch.cat([torch.arange(n), torch.full((64 - n,), req_to_token.shape[1])]).repeat(2, 1)


class _Recorder(_KeepRecent):
    def __init__(self, config: _RecentConfig) -> None:
        super().__init__(config)
        self.calls: list[str] = []
        self._selector = _RecordingSelector(self.calls)

    @property
    def selector(self) -> _RecordingSelector:
        return self._selector

    def on_prefill_chunk(self, state: RequestState, chunk: PrefillChunk) -> None:
        self.calls.append(f"chunk{chunk.start}-{chunk.end}{'F' if chunk.is_final else ''}")

    def observation_window(self) -> int:
        return 5

    def on_observation(self, state: RequestState, window: ObservationWindow) -> None:
        assert sorted(window.queries) == list(range(N_LAYERS))
        assert window.queries[0].shape == (5, 4, 16) and window.q_pos.tolist() == [5, 6, 7, 8, 9]
        k, pos = window.keys(1)
        assert k.shape == (10, 2, 16) and pos.tolist() == list(range(10))
        self.calls.append("observation")

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        self.calls.append(f"step_end({'P' if step.is_prefill else 'D'},{step.new_tokens})")
        return super().on_step_end(state, step)

    def on_finish(self, state: RequestState):  # type: ignore[no-untyped-def]
        self.calls.append("finish")
        return None


def _tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_dense_through_contract_equals_full_attention(chunk_size: int) -> None:
    model = ToyAttentionStack(n_layers=N_LAYERS)
    tokens = _tokens(40)
    trace = run_request(create_method("dense"), model, tokens, prompt_len=30, chunk_size=chunk_size)
    torch.testing.assert_close(trace.outputs, dense_reference(model, tokens), rtol=1e-5, atol=1e-5)
    assert trace.kept_after_step[-1] == 40


def test_hook_order() -> None:
    m = _Recorder(_RecentConfig(budget=100))
    tokens = _tokens(12)
    trace = run_request(m, ToyAttentionStack(n_layers=N_LAYERS), tokens, prompt_len=10, chunk_size=6)
    prefill = [f"kv{i}" for i in range(1, N_LAYERS)]
    decode = ["observe0"] + [f"{w}{i}" for i in range(1, N_LAYERS) for w in ("kv", "select")]
    assert m.calls == [
        "chunk0-6", *prefill, "step_end(P,6)",
        "chunk6-10F", *prefill, "observation", "step_end(P,4)",
        *decode, "step_end(D,1)",
        *decode, "step_end(D,1)",
        "finish",
    ]
    # Every token selected: the selection path reproduces dense attention.
    torch.testing.assert_close(trace.outputs, dense_reference(ToyAttentionStack(n_layers=N_LAYERS), tokens),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "covering", "small"), [
    ("quest", {"token_budget": 64, "page_size": 4, "sink_tokens": 4, "recent_tokens": 4, "dense_layers": 0},
     {"token_budget": 12, "page_size": 4, "sink_tokens": 4, "recent_tokens": 4, "dense_layers": 0}),
    ("omnikv", {"token_budget": 64, "sink_tokens": 2, "recent_tokens": 2, "filter_layers": "0"},
     {"token_budget": 8, "sink_tokens": 2, "recent_tokens": 2, "filter_layers": "0"}),
])
def test_selection_methods_through_the_reference_driver(name: str, covering: dict, small: dict) -> None:
    """The reference driver runs a method's selector as the server does: a budget covering the context is
    dense; a small one changes the decode outputs (prefill stays dense)."""
    model = ToyAttentionStack(n_layers=N_LAYERS)
    tokens = _tokens(48, seed=5)
    dense = dense_reference(model, tokens)
    full = run_request(create_method(name, covering), model, tokens, prompt_len=30, chunk_size=8)
    torch.testing.assert_close(full.outputs, dense, rtol=1e-5, atol=1e-5)
    part = run_request(create_method(name, small), model, tokens, prompt_len=30, chunk_size=8)
    torch.testing.assert_close(part.outputs[:30], dense[:30], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(part.outputs[30:], dense[30:], atol=1e-3)


def test_eviction_with_budget_covering_context_is_exactly_dense() -> None:
    model = ToyAttentionStack(n_layers=N_LAYERS)
    tokens = _tokens(50, seed=3)
    dense = run_request(create_method("dense"), model, tokens, prompt_len=40, chunk_size=16)
    evict = run_request(_KeepRecent(_RecentConfig(budget=50)), model, tokens, prompt_len=40, chunk_size=16)
    assert torch.equal(evict.outputs, dense.outputs)


def test_eviction_under_budget_bounds_kept_and_changes_output() -> None:
    model = ToyAttentionStack(n_layers=N_LAYERS)
    tokens = _tokens(50, seed=3)
    dense = run_request(create_method("dense"), model, tokens, prompt_len=40, chunk_size=16)
    evict = run_request(_KeepRecent(_RecentConfig(budget=8)), model, tokens, prompt_len=40, chunk_size=16)
    assert max(evict.kept_after_step) == 8
    assert evict.state.kept.tolist() == list(range(42, 50))
    # Tokens whose whole history fits the budget are unaffected; later ones are not.
    torch.testing.assert_close(evict.outputs[:8], dense.outputs[:8])
    assert not torch.allclose(evict.outputs[-1], dense.outputs[-1])


def test_keep_plan_rules_are_enforced() -> None:
    class _Bad(_KeepRecent):
        def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
            return KeepPlan(torch.tensor([state.logical_len + 5]))

    with pytest.raises(RuntimeError, match="not retained"):
        run_request(_Bad(_RecentConfig()), ToyAttentionStack(), _tokens(10), prompt_len=8, chunk_size=8)

    class _NotEvicting(_KeepRecent):
        evicts = False

    with pytest.raises(RuntimeError, match="does not declare evicts"):
        run_request(_NotEvicting(_RecentConfig(budget=2)), ToyAttentionStack(), _tokens(10), 8, 8)


def test_per_request_hooks_of_a_method_the_server_would_not_drive_are_refused() -> None:
    """The server drives per-request hooks only for evicting or observing methods: a method that overrides
    one without either is refused at launch, not served with the hook silently never called."""
    from sgl_sparse.contract import TreePayload
    from sgl_sparse.methods.dense import Dense
    from sgl_sparse.rules import served_hooks_problem

    class FinishOnly(Dense):
        def on_finish(self, state: RequestState) -> TreePayload | None:
            return None

    assert served_hooks_problem(create_method("dense")) is None
    problem = served_hooks_problem(FinishOnly(create_method("dense").config))
    assert problem is not None and "on_finish" in problem


def test_method_modules_register_more_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLSPARSE_METHOD_MODULES imports a user's method modules (the hook probe here); a module that does
    not import is a config error naming it."""
    from sgl_sparse.errors import SparseConfigError
    from sgl_sparse.registry import registered_methods

    monkeypatch.setenv("SGLSPARSE_METHOD_MODULES", "tests.hook_probe")
    assert "hook_probe" in registered_methods()
    monkeypatch.setenv("SGLSPARSE_METHOD_MODULES", "tests.hook_probe, no_such_module_here")
    with pytest.raises(SparseConfigError, match="no_such_module_here"):
        registered_methods()


# -- a request's own prune (SparseMethod.on_prune) ------------------------------------------------------------
class _KeepLastRetained(_KeepRecent):
    """Keep the last ``budget`` retained positions after every step (plans from ``state.kept``)."""

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        return KeepPlan(state.kept[-self.config.budget:]) if state.num_kept > self.config.budget else None


class _PruneRecorder(_KeepLastRetained):
    def __init__(self, config: _RecentConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple] = []

    def on_prune(self, state: RequestState, pruned: torch.Tensor) -> None:
        self.calls.append(("prune", pruned.tolist(), state.kept.tolist()))

    def observation_window(self) -> int:
        return 3

    def on_observation(self, state: RequestState, window: ObservationWindow) -> None:
        self.calls.append(("observation", window.k_pos.tolist(), window.q_pos.tolist()))

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        self.calls.append(("step_end", step.final_prefill, state.kept.tolist()))
        return super().on_step_end(state, step)


def test_prune_comes_before_the_methods_end_of_prompt_hooks() -> None:
    """The final chunk's forward attends every position; then on_prune gets the retained positions of the ranges
    (the kept set still holding them), and the observation window and on_step_end see only the rest."""
    m = _PruneRecorder(_RecentConfig(budget=100))
    run_request(m, ToyAttentionStack(n_layers=N_LAYERS), _tokens(12), prompt_len=10, chunk_size=6,
                prune=[(2, 4), (7, 8)])
    rest = [0, 1, 4, 5, 6, 8, 9]
    assert m.calls == [
        ("step_end", False, list(range(6))),
        ("prune", [2, 3, 7], list(range(10))),
        ("observation", rest, [7, 8, 9]),
        ("step_end", True, rest),
        ("step_end", False, [*rest, 10]),
        ("step_end", False, [*rest, 10, 11]),
    ]


def test_prune_composes_with_earlier_evictions_and_the_budget_counts_what_is_left() -> None:
    """Positions a plan already evicted are not handed over again (the union leaves); the plan after the prune
    keeps ``budget`` of the positions left, never a pruned one."""
    m = _PruneRecorder(_RecentConfig(budget=8))
    trace = run_request(m, ToyAttentionStack(n_layers=N_LAYERS), _tokens(18), prompt_len=16, chunk_size=6,
                        prune=[(2, 6), (10, 12)])
    assert ("prune", [4, 5, 10, 11], list(range(4, 16))) in m.calls  # 0..3 left with the second chunk's plan
    assert trace.kept_after_step == [6, 8, 8, 8, 8]  # 8 left after the prune: within the budget, no plan
    assert trace.state.kept.tolist() == [8, 9, 12, 13, 14, 15, 16, 17]


def test_a_plan_that_reselects_a_pruned_position_is_refused() -> None:
    with pytest.raises(RuntimeError, match="not retained"):
        # _KeepRecent plans the last `budget` logical positions, a pruned one among them.
        run_request(_KeepRecent(_RecentConfig(budget=8)), ToyAttentionStack(), _tokens(12), prompt_len=10,
                    chunk_size=10, prune=[(5, 7)])


def test_dense_with_a_prune_decodes_as_attention_without_the_ranges() -> None:
    """The prompt attends every position (its outputs are dense); each decoded token attends every position but
    the pruned ones: plain causal attention with those keys masked for the decode queries."""
    model, tokens, prompt_len, ranges = ToyAttentionStack(n_layers=N_LAYERS), _tokens(40), 30, [(3, 9), (20, 24)]
    trace = run_request(create_method("dense"), model, tokens, prompt_len=prompt_len, chunk_size=7, prune=ranges)
    pruned = torch.zeros(len(tokens), dtype=torch.bool)
    for lo, hi in ranges:
        pruned[lo:hi] = True
    h = model.embed[torch.tensor(tokens)]
    pos = torch.arange(len(tokens))
    hidden = (pos[None, :] > pos[:, None]) | ((pos[:, None] >= prompt_len) & pruned[None, :])  # [query, key]
    for layer in range(model.n_layers):
        q, k, v = model.project(layer, h)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        h = torch.einsum("hqk,khd->qhd", s.masked_fill(hidden[None], float("-inf")).softmax(-1), v).reshape(
            len(tokens), -1)
    torch.testing.assert_close(trace.outputs, h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trace.outputs[:prompt_len], dense_reference(model, tokens)[:prompt_len])
    assert trace.state.kept.tolist() == [p for p in range(40) if not pruned[p]]
