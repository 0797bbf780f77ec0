"""OmniKV's scores and selection (sgl_sparse/kernels/omnikv.py, methods/selection/omnikv.py) against
plain-torch references written here; the Triton scorer under TRITON_INTERPRET=1 in a subprocess."""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.contract import KVGeometry
from sgl_sparse.errors import SparseConfigError
from sgl_sparse.kernels import omnikv
from sgl_sparse.methods.selection.omnikv import OmniKVConfig, OmniKVSelector, parse_filter_layers

HKV, G, D = 2, 3, 16


def _setup(seed: int = 0, lens: tuple[int, ...] = (37, 64, 5, 1)):
    """A pool whose requests' tokens live in random slots (slot 0 is padding, never a token's)."""
    g = torch.Generator().manual_seed(seed)
    slots, width = 256, 80
    k_cache = torch.randn(slots, HKV, D, generator=g)
    r2t = torch.zeros(len(lens) + 1, width, dtype=torch.int32)
    free = (torch.randperm(slots - 1, generator=g) + 1).tolist()
    for row, n in enumerate(lens, start=1):
        r2t[row, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    rpi = torch.arange(1, len(lens) + 1)
    seq = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), HKV * G, D, generator=g)
    return k_cache, r2t, rpi, seq, q


def _reference(k_cache, r2t, rpi, seq, q, budget, sink, recent):
    """Per request: each token's largest q.k over every query head; sink and recent forced; the top
    ``budget`` positions, ascending (one set for all KV heads)."""
    out = []
    for b, (row, n) in enumerate(zip(rpi.tolist(), seq.tolist())):
        scored = []
        for t in range(n):
            k = k_cache[int(r2t[row, t])]
            s = max(float(q[b, h] @ k[h // G]) for h in range(HKV * G))
            forced = t < sink or t >= n - recent
            scored.append((float("inf") if forced else s, -t))
        out.append(sorted(-t for _, t in sorted(scored, reverse=True)[:budget]))
    return out


def _selector(budget: int, sink: int, recent: int, filters: str = "0") -> OmniKVSelector:
    sel = OmniKVSelector(OmniKVConfig(token_budget=budget, sink_tokens=sink, recent_tokens=recent,
                                      filter_layers=filters))
    sel.allocate(KVGeometry(num_layers=4, num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, page_size=1,
                            num_slots=256, dtype=torch.float32, device=torch.device("cpu")))
    return sel


@pytest.mark.parametrize(("budget", "sink", "recent"), [(8, 2, 3), (6, 0, 1), (100, 4, 4), (3, 1, 1)])
def test_selection_matches_reference(budget: int, sink: int, recent: int) -> None:
    k_cache, r2t, rpi, seq, q = _setup(seed=budget)
    sel = _selector(budget, sink, recent)
    sel.observe(0, q, k_cache, r2t, rpi, seq)
    got = sel.select(1, q, r2t, rpi, seq)
    assert got.shape == (len(seq) * HKV, min(budget, r2t.shape[1]))
    ref = _reference(k_cache, r2t, rpi, seq, q, budget, sink, recent)
    for b, want in enumerate(ref):
        for h in range(HKV):
            assert [p for p in got[b * HKV + h].tolist() if p < r2t.shape[1]] == want, (b, h)


def test_budget_covering_the_context_selects_every_token() -> None:
    k_cache, r2t, rpi, seq, q = _setup(seed=5)
    sel = _selector(80, 1, 1)
    sel.observe(0, q, k_cache, r2t, rpi, seq)
    got = sel.select(1, q, r2t, rpi, seq)
    for b, n in enumerate(seq.tolist()):
        assert [p for p in got[b * HKV].tolist() if p < r2t.shape[1]] == list(range(n))


def test_layers_filters_and_config_errors() -> None:
    sel = _selector(8, 1, 1, filters="0,2")
    assert [sel.observes(i) for i in range(4)] == [True, False, True, False]
    assert [sel.selects(i) for i in range(4)] == [False, True, False, True]
    assert parse_filter_layers("auto", 32) == (2, 8, 18)
    assert parse_filter_layers("auto", 4) == (1, 2)
    with pytest.raises(ValueError, match="4 layers"):
        parse_filter_layers("1,4", 4)
    for bad in ({"filter_layers": "2,1"}, {"filter_layers": "x"}, {"token_budget": 8, "sink_tokens": 4,
                                                                    "recent_tokens": 4}, {"scoring": "max"}):
        with pytest.raises(SparseConfigError):
            OmniKVConfig(**bad)
    fresh = OmniKVSelector(OmniKVConfig())
    with pytest.raises(RuntimeError, match="filter layer"):
        fresh.select(1, torch.zeros(1, 2, 4), torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1), torch.ones(1))


@pytest.mark.skipif(not INTERPRETED, reason="Triton kernel: run by test_triton_kernel_under_the_interpreter")
def test_triton_scores_match_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(omnikv, "BLOCK_TOKENS", 8)  # several blocks per program at small shapes
    monkeypatch.setattr(omnikv, "MIN_PROGRAMS_PER_ROW", 3)
    monkeypatch.setattr(omnikv, "MAX_PROGRAMS_PER_ROW", 3)
    k_cache, r2t, rpi, seq, q = _setup(seed=7)
    for sink, recent in ((2, 3), (0, 1)):
        ref = torch.empty(len(seq), r2t.shape[1])
        omnikv.score_tokens_torch(q, k_cache, r2t, rpi, seq, ref, sink, recent)
        got = torch.full_like(ref, float("-inf"))
        omnikv.score_tokens(q, k_cache, r2t, rpi, seq, got, sink, recent, mma=False)
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
        mma = torch.full_like(ref, float("-inf"))  # the tensor-core form
        omnikv.score_tokens(q, k_cache, r2t, rpi, seq, mma, sink, recent, mma=True)
        assert torch.allclose(mma, ref, atol=1e-5), (mma - ref).abs().max()


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_triton_kernel_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)


def test_programs_per_row_fill_the_gpu_at_any_batch() -> None:
    assert [omnikv.programs_per_row(bs) for bs in (1, 2, 6, 16, 32, 64)] == [1024, 1024, 512, 128, 64, 64]


def test_torch_scores_are_max_logits() -> None:
    k_cache, r2t, rpi, seq, q = _setup(seed=9)
    out = torch.empty(len(seq), r2t.shape[1])
    omnikv.score_tokens_torch(q, k_cache, r2t, rpi, seq, out, 0, 1)
    b, t = 1, 10
    k = k_cache[int(r2t[2, t])]
    assert out[b, t].item() == pytest.approx(max(float(q[b, h] @ k[h // G]) for h in range(HKV * G)), abs=1e-5)
    assert out[b, int(seq[b]) - 1] == float("inf") and out[b, int(seq[b])] == float("-inf")
