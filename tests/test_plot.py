"""benchmarks/plot.py: the committed decode_130k.csv parses, every point names a run folder and notes file that
exist, and the plot is written (where matplotlib is installed: the `bench` extra)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _plot_module():
    spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "benchmarks" / "plot.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_points_name_their_runs():
    mod = _plot_module()
    points = mod.read_points(mod.DEFAULT_CSV)
    assert points and all(p.batch > 0 and p.tok_s > 0 for p in points)
    assert any(p.method == "vanilla" for p in points)
    with mod.DEFAULT_CSV.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    for r in rows:
        assert (RESULTS / r["run"]).is_dir(), r
        assert (RESULTS / r["notes"]).is_file(), r


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    mod = _plot_module()
    out = tmp_path / "p.png"
    mod.main(["--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
