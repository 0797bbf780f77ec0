"""benchmarks/bench_rows.py without a GPU: a run's result files become BENCHMARKS.md rows (each method against the
vanilla of its run) and the plot's CSV points."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_rows_pair_each_method_with_its_runs_vanilla(tmp_path: Path) -> None:
    dt, rows = _load("decode_throughput"), _load("bench_rows")
    vanilla = dt.Result("vanilla", batch=6, decode_tok_s=215.0, input_len=130000, output_len=256,
                        kv_tokens_in_use=781000, kv_token_capacity=788603, mem_fraction_static=0.8)
    h2o = dt.Result("sgl_sparse:h2o", batch=6, decode_tok_s=860.0, config="h2o {}", input_len=130000, output_len=256,
                    kv_tokens_in_use=55000, kv_token_capacity=780000, mem_fraction_static=0.8)
    quest = dt.Result("sgl_sparse:quest", batch=6, decode_tok_s=645.0, config='quest {"budget": 2048}',
                      input_len=130000, output_len=256, kv_tokens_in_use=781000, kv_token_capacity=790000,
                      mem_fraction_static=0.85)
    short = dt.Result("sgl_sparse:palu", batch=16, decode_tok_s=1200.0, config="palu {}", input_len=32768)
    path = tmp_path / "run.json"
    path.write_text(json.dumps([asdict(r) for r in (vanilla, h2o, quest, short)]))
    results = dt.load_results(path)
    md = rows.markdown_rows(results, "2026-12-07", "H200", "2026-12-07/NOTES.md")
    assert len(md) == 3 and not any(line.startswith("| `vanilla`") for line in md)
    assert md[0].startswith("| `h2o` | eviction | 860.0 (6) at 130,000 in | 215.0 (6), same run | **4.00x** |")
    assert "`quest` {\"budget\": 2048} | selection" in md[1] and "--mem-fraction-static 0.85" in md[1]
    assert "compression" in md[2] and "**5.58x**" in md[2]
    points = rows.csv_rows(results, "2026-12-07", "H200", "2026-12-07-device", "2026-12-07/NOTES.md")
    assert [p[:4] for p in points] == [["vanilla", "vanilla", "6", "215.0"], ["h2o", "eviction", "6", "860.0"],
                                       ["quest", "selection", "6", "645.0"]]  # 130K runs only
    alone = dt.load_results(path)[1:2]  # an --only sgl_sparse file on its own
    assert "no vanilla in this run" in rows.markdown_rows(alone, "2026-12-07", "H200", "")[0]
