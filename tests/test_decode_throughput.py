"""benchmarks/decode_throughput.py without a server: the log window, old result files, the tables."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("decode_throughput", ROOT / "benchmarks" / "decode_throughput.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["decode_throughput"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


dt = _load()


def _prefill(ts: str, running: int, new: int = 16384) -> str:
    return (f"[{ts}] Prefill batch, #new-seq: 1, #new-token: {new}, #cached-token: 0, token usage: 0.10, "
            f"#running-req: {running}, #queue-req: 0, #pending-token: 0, cuda graph: False, "
            f"input throughput (token/s): 9000.00")


def _decode(ts: str, running: int, tokens: int, tput: float) -> str:
    return (f"[{ts}] Decode batch, #running-req: {running}, #token: {tokens}, token usage: 0.50, "
            f"cuda graph: True, gen throughput (token/s): {tput:.2f}, #queue-req: 0")


# Warm-up prefills at start-up, then 4 requests prefilled one by one with decode steps in between, the
# full batch decoding, one request finishing early (3 running), and the last ones at the end.
LOG = "\n".join([
    "[2026-12-01 10:00:00.000] server_args=ServerArgs(...)",
    _prefill("2026-12-01 10:00:01.000", 0, new=23),
    _prefill("2026-12-01 10:00:02.000", 1, new=1),
    _decode("2026-12-01 10:00:05.000", 4, 10, 999.0),  # a full batch *before* the last prefill: not in the window
    _prefill("2026-12-01 10:00:10.000", 0),
    _decode("2026-12-01 10:00:11.000", 1, 16400, 50.0),
    _prefill("2026-12-01 10:00:12.000", 1),
    _decode("2026-12-01 10:00:13.000", 2, 32800, 90.0),
    _prefill("2026-12-01 10:00:14.000", 2),
    "[2026-12-01 10:00:14.500] INFO:     127.0.0.1:5555 - \"POST /generate HTTP/1.1\" 200 OK",
    _prefill("2026-12-01 10:00:15.000", 3),
    _decode("2026-12-01 10:00:15.250", 4, 65600, 20.0),  # dropped: its interval holds the last prefill
    _decode("2026-12-01 10:00:15.750", 4, 65640, 80.0),
    _decode("2026-12-01 10:00:16.250", 4, 65680, 82.0),
    _decode("2026-12-01 10:00:16.750", 4, 65720, 81.0),
    _decode("2026-12-01 10:00:17.250", 4, 65760, 79.0),
    _decode("2026-12-01 10:00:17.500", 3, 49300, 200.0),  # a request finished: not the full batch
    _decode("2026-12-01 10:00:17.750", 1, 16420, 30.0),
])


def test_window_is_full_batch_decode_after_the_last_prefill_less_its_first_line() -> None:
    w = dt.decode_window(LOG, batch=4, interval=10)
    assert (w.lines, w.interval, w.steps) == (4, 10, 40)
    assert w.median_tok_s == pytest.approx(80.5)  # of 80, 82, 81, 79; not 20 (dropped) nor 999 (before)
    assert w.kv_tokens_in_use == 65760
    assert (w.first_ts, w.last_ts) == ("2026-12-01 10:00:15.250", "2026-12-01 10:00:17.250")
    assert w.window_s == pytest.approx(2.0)
    assert w.window_tok_s == pytest.approx(4 * 40 / 2.0)
    assert w.last_prefill_ts == "2026-12-01 10:00:15.000"


def test_prefills_logged_after_the_batch_finished_do_not_empty_the_window() -> None:
    later = LOG + "\n" + _prefill("2026-12-01 10:01:00.000", 0, new=1)  # e.g. a health check afterwards
    assert dt.decode_window(later, batch=4) == dt.decode_window(LOG, batch=4)


def test_seconds_only_timestamps_a_process_prefix_and_no_timestamps() -> None:
    secs = "\n".join([
        "[2026-11-30 11:53:40 TP0] Prefill batch, #new-seq: 1, #new-token: 5, #cached-token: 0, token usage: 0.1, "
        "#running-req: 1, #queue-req: 0, cuda graph: False, input throughput (token/s): 1.00",
        *[_decode(f"2026-11-30 11:53:{41 + i}", 2, 100 + i, 10.0 + i).replace("]", " TP0]", 1) for i in range(4)],
    ])
    w = dt.decode_window(secs, batch=2)
    assert (w.lines, w.steps, w.median_tok_s, w.kv_tokens_in_use) == (3, 30, 12.0, 103)
    assert w.window_s == pytest.approx(3.0) and w.last_prefill_ts == "2026-11-30 11:53:40"
    bare = "\n".join(line.split("] ", 1)[1] for line in LOG.splitlines())
    w = dt.decode_window(bare, batch=4)
    assert (w.lines, w.median_tok_s) == (4, pytest.approx(80.5))
    assert w.first_ts is None and w.window_s is None and w.window_tok_s is None


def test_windows_that_cannot_be_measured_say_why() -> None:
    with pytest.raises(ValueError, match="#running-req: 8.*at most 4 ran together.*--sparse-batch 4"):
        dt.decode_window(LOG, batch=8)
    short = "\n".join([_prefill("2026-12-01 10:00:00.000", 1), _decode("2026-12-01 10:00:01.000", 2, 10, 5.0)])
    with pytest.raises(ValueError, match="longer --output-len"):
        dt.decode_window(short, batch=2)


def test_floor() -> None:
    cfg = json.loads((ROOT / "sgl_sparse" / "assets" / "quality-large" / "config.json").read_text())
    weight_b, kv_b = dt.model_bytes(cfg)
    assert kv_b == 6 * 2 * 64 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16
    floor = dt.floor_tok_s(4, weight_b, kv_b, 10_000, 4.3)
    assert floor == pytest.approx(4 / ((weight_b + 10_000 * kv_b) / 4.3e12))


def test_selection_floor_counts_what_a_step_reads() -> None:
    """Quest and OmniKV read part of the KV: their floor counts it by hand here (Llama-3-8B's shape: 32 layers,
    8 KV heads x 128, 4,096 bytes a token and layer), not every token in use."""
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
    tok = 8 * 128 * 2 * 2
    n, b = 6 * 130_000, 6
    quest = {"token_budget": 2048, "page_size": 16, "dense_layers": 2}
    want = 2 * n * tok + 30 * (b * 2048 + b * -(-130_000 // 16)) * tok
    assert dt.selection_kv_bytes("quest", quest, cfg, b, n) == want
    omni = {"token_budget": 2048, "filter_layers": "2,8,18"}
    # layers 0-1 and the filter layers 2, 8, 18 read all, the filters K again, 27 layers the budget
    assert dt.selection_kv_bytes("omnikv", omni, cfg, b, n) == 5 * n * tok + 3 * n * tok // 2 + 27 * b * 2048 * tok
    # RetroInfer's defaults at 130,000 tokens: 126 segments of 1,024 past the 16-token base and the 64 recent
    # (8,064 clusters: 145 retrieved, 1,871 estimated); centroids + sizes of all, centroid + value sum of the
    # estimated, the sink + tail (130,000 - 126 x 1,024 = 976 tokens) and 145 clusters of 16 exactly.
    head_vec = 8 * 128 * 2
    per_layer = 8064 * (head_vec + 4 * 8) + 1871 * 2 * head_vec + (976 + 145 * 16) * tok
    assert dt.selection_kv_bytes("retroinfer", {}, cfg, b, n) == b * 32 * per_layer
    # Under min_index_tokens: dense.
    assert dt.selection_kv_bytes("retroinfer", {}, cfg, b, 6 * 10_000) == 6 * 10_000 * tok * 32
    # A budget above the context reads the context (no more).
    assert dt.selection_kv_bytes("omnikv", {**omni, "token_budget": 10**6}, cfg, b, n) == \
        5 * n * tok + 3 * n * tok // 2 + 27 * n * tok
    assert dt.floor_tok_s(b, 16 * 10**9, tok * 32, n, 4.3, want) > dt.floor_tok_s(b, 16 * 10**9, tok * 32, n, 4.3)


def _row(**kw):  # type: ignore[no-untyped-def]
    base = dict(server="vanilla", attention_backend="flashinfer", batch=4, decode_tok_s=100.0,
                decode_steps_at_full_batch=40, kv_tokens_in_use=65760, kv_token_capacity=788603, wall_s=10.0,
                floor_tok_s=200.0)
    return dt.Result(**{**base, **kw})


def test_old_result_files_load_with_defaults(tmp_path: Path) -> None:
    old = [{"server": "vanilla", "batch": 16, "decode_tok_s": 505.11, "decode_steps_at_full_batch": 103,
            "kv_tokens_in_use": 540640, "kv_token_capacity": 788603, "wall_s": 71.7, "floor_tok_s": 791.5,
            "a_field_from_the_future": 1}]
    (tmp_path / "old.json").write_text(json.dumps(old))
    (r,) = dt.load_results(tmp_path / "old.json")
    assert r.attention_backend == "?" and r.window_lines is None and r.prefill_phase_s is None
    table = dt.detail_table([r])
    assert "103 full-batch log lines (older run: no window)" in table and "| 71.7 | - |" in table


def test_json_round_trip_and_tables(tmp_path: Path) -> None:
    ours = _row(server="sgl_sparse:snapkv", attention_backend="SparseFlashInferBackend", attention_base="flashinfer",
                config='snapkv {"budget": 2048}', batch=6, decode_tok_s=250.0, floor_tok_s=500.0, input_len=16384,
                output_len=256, decode_log_interval=10, window_lines=4, window_first_ts="2026-12-01 10:00:15.250",
                window_last_ts="2026-12-01 10:00:17.250", window_s=2.0, window_tok_s=120.0,
                wall_output_tok_s=153.6, prefill_phase_s=4.5, mem_fraction_static=0.85)
    vanilla = _row(attention_base="flashinfer", input_len=16384, output_len=256, wall_output_tok_s=102.4,
                   mem_fraction_static=0.8)
    (tmp_path / "r.json").write_text(json.dumps([asdict(vanilla), asdict(ours)]))
    assert dt.load_results(tmp_path / "r.json") == [vanilla, ours]
    comparison = dt.comparison_table([vanilla, ours]).splitlines()
    assert len(comparison) == 3  # header, rule, one row: ours against vanilla
    row = comparison[2]
    assert row.startswith('| snapkv {"budget": 2048}, 16384 in / 256 out (mem 0.85) | 6 / 4 | 250.0 | 100.0 '
                          '(flashinfer) |')
    assert "| 2.500 |" in row
    assert "| 500 (50%) | 200 (50%) | 10.0 / 10.0 | 153.6 / 102.4 |" in row
    detail = dt.detail_table([vanilla, ours])
    assert "| 4 x 10 = 40 | 2026-12-01 10:00:15.250 -> 2026-12-01 10:00:17.250 (2.00 s) | 120.0 |" in detail
    assert "| SparseFlashInferBackend (flashinfer) |" in detail and "| 4.5 | 10.0 | 153.6 |" in detail
    # a server given more memory than vanilla's says so beside its pool (vanilla's own fraction is not repeated)
    assert "| 65760 of 788603 (mem 0.85) |" in detail and detail.count("(mem ") == 1
    same = dt.detail_table([vanilla, replace(ours, mem_fraction_static=0.8)])
    assert "(mem " not in same and "(mem " not in dt.comparison_table([vanilla, replace(ours, mem_fraction_static=0.8)])


def test_each_run_is_compared_with_its_own_vanilla() -> None:
    v1, o1 = _row(decode_tok_s=100.0), _row(server="sgl_sparse:dense", decode_tok_s=100.0)
    v2, o2 = _row(decode_tok_s=200.0), _row(server="sgl_sparse:snapkv", decode_tok_s=600.0)
    rows = dt.comparison_table([v1, o1, v2, o2]).splitlines()[2:]
    assert [r.split(" | ")[4] for r in rows] == ["1.000", "3.000"]
    # --only runs given ours first: the vanilla row after it is its baseline.
    (row,) = dt.comparison_table([o2, v2]).splitlines()[2:]
    assert row.split(" | ")[4] == "3.000"
    # An --only sgl_sparse run alone: no pair (it used to be compared with itself, ratio 1.000).
    assert dt.comparison_table([o2]).splitlines()[2:] == []


def test_profile_summary_busy_idle_and_steps(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("profile_summary", ROOT / "benchmarks" / "profile_summary.py")
    assert spec and spec.loader
    ps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ps)
    # Two steps of 1,000 us: kernels overlap inside a step (streams), then 200 us of GPU idle each.
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "attn", "ts": 0, "dur": 600},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 500, "dur": 300},  # overlaps attn by 100
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1000, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "attn", "ts": 1000, "dur": 600},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1700, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "step", "ts": 0, "dur": 900},
    ]
    busy, gaps = ps.busy_union([(e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] in ps.GPU_CATS])
    assert busy == 800 + 600 + 100 and gaps == [200, 100]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text = ps.summarise(ps.load(path), top=5)
    assert "GPU span 1.80 ms, busy 1.50 ms (83.3%), idle 0.30 ms in 2 gaps" in text
    assert "CUDA graph launches (decode steps): 2" in text
    assert "| attn | 2 | 1.20 |" in text and "| step | 1 | 0.90 |" in text
