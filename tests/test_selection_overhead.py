"""benchmarks/selection_overhead.py's RetroInfer row on the CPU under the Triton interpreter, at a small width: its
synthetic index is one the kernels read as served (the tiers equal the sorted top-k's sets, the decode equals the
torch path), so the H200 timings measure the served path and not a malformed input."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.skipif(not INTERPRETED, reason="Triton kernels: run by test_retroinfer_row_under_the_interpreter")
def test_retroinfer_row_reads_a_served_index(monkeypatch: pytest.MonkeyPatch) -> None:
    import selection_overhead as so

    from sgl_sparse.kernels import retroinfer as ri
    from sgl_sparse.methods.selection.retroinfer import RetroInferConfig

    monkeypatch.setattr(so, "DEVICE", "cpu")
    # The served path at a small width: an index from one segment on (not 16K tokens), and the group's
    # probabilities in 128-cluster chunks (not 1,024), so three segments' 192 clusters take a full chunk and a
    # partial one, as 17 segments' 1,088 do at the defaults (and the tiers a block and its tail).
    monkeypatch.setattr(so, "RetroInferConfig", functools.partial(RetroInferConfig, min_index_tokens=1024))
    monkeypatch.setattr(ri, "GROUP_CHUNK", 128)
    monkeypatch.setattr(so, "WIDTH", 4 * 1024 + 4)
    calls: list[object] = []

    def run_once(fn, **_):  # type: ignore[no-untyped-def]
        calls.append(fn())
        return 1.0

    monkeypatch.setattr(so, "graph_us", run_once)
    real_decode = ri.decode_attention
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def checked_decode(*args, **kw):  # type: ignore[no-untyped-def]
        out = real_decode(*args, **kw)
        outputs.append((out, ri.decode_attention_torch(*args)))
        return out

    monkeypatch.setattr(ri, "decode_attention", checked_decode)
    real_probs, real_tiers = ri.group_probs, ri.rank_clusters_triton
    prob_widths: list[int] = []
    budgets: list[tuple[torch.Tensor, torch.Tensor]] = []

    def probs(logits: torch.Tensor) -> torch.Tensor:
        prob_widths.append(logits.shape[-1])
        return real_probs(logits)

    def tiers(scores, width, retrieved, estimated, rows_per_request):  # type: ignore[no-untyped-def]
        budgets.append((retrieved, estimated))
        return real_tiers(scores, width, retrieved, estimated, rows_per_request)

    monkeypatch.setattr(ri, "group_probs", probs)
    monkeypatch.setattr(ri, "rank_clusters_triton", tiers)
    row = so._retroinfer_row(2, 3 * 1024 + 100, [4])
    assert "(True)" in row  # the Triton tiers hold the sorted top-k's sets
    assert prob_widths and all(w % ri.GROUP_CHUNK and w > ri.GROUP_CHUNK for w in prob_widths)  # chunked
    assert budgets and all(bool((r > 0).all() and (e > 0).all()) for r, e in budgets)  # every row indexed
    assert outputs
    for got, want in outputs:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_retroinfer_row_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
