"""benchmarks/selection_overhead.py's RetroInfer row on the CPU under the Triton interpreter, at a small width: its
synthetic index is one the kernels read as served (the tiers equal the sorted top-k's sets, the decode equals the
torch path), so the H200 timings measure the served path and not a malformed input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from interpreted import INTERPRETED, rerun_interpreted

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.skipif(not INTERPRETED, reason="Triton kernels: run by test_retroinfer_row_under_the_interpreter")
def test_retroinfer_row_reads_a_served_index(monkeypatch: pytest.MonkeyPatch) -> None:
    import selection_overhead as so

    from sgl_sparse.kernels import retroinfer as ri

    monkeypatch.setattr(so, "DEVICE", "cpu")
    monkeypatch.setattr(so, "WIDTH", 18 * 1024 + 4)
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
    row = so._retroinfer_row(2, 17 * 1024 + 100, [4])
    assert "(True)" in row  # the Triton tiers hold the sorted top-k's sets
    assert outputs
    for got, want in outputs:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_retroinfer_row_under_the_interpreter() -> None:
    rerun_interpreted(__file__)
