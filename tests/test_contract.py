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
    LayerInput,
    ObservationWindow,
    PrefillChunk,
    RequestState,
    Selection,
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


class _Recorder(_KeepRecent):
    needs_layer_hooks = True

    def __init__(self, config: _RecentConfig) -> None:
        super().__init__(config)
        self.calls: list[str] = []

    def on_prefill_chunk(self, state: RequestState, chunk: PrefillChunk) -> None:
        self.calls.append(f"chunk{chunk.start}-{chunk.end}{'F' if chunk.is_final else ''}")

    def before_attention(self, state: RequestState, layer: LayerInput) -> Selection | None:
        assert layer.q.shape[1:] == (4, 16) and layer.k.shape[1:] == (2, 16)
        assert bool((layer.kv_pos[1:] > layer.kv_pos[:-1]).all()), "kv_pos must be sorted"
        self.calls.append(f"before{layer.layer_id}")
        return None

    def after_attention(self, state: RequestState, layer: LayerInput, out: torch.Tensor) -> None:
        self.calls.append(f"after{layer.layer_id}")

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
    run_request(m, ToyAttentionStack(n_layers=N_LAYERS), _tokens(12), prompt_len=10, chunk_size=6)
    layers = [f"{w}{i}" for i in range(N_LAYERS) for w in ("before", "after")]
    assert m.calls == [
        "chunk0-6", *layers, "step_end(P,6)",
        "chunk6-10F", *layers, "observation", "step_end(P,4)",
        *layers, "step_end(D,1)",
        *layers, "step_end(D,1)",
        "finish",
    ]


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
