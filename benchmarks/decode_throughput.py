"""Decode throughput: vanilla SGLang vs sgl_sparse, same GPU, same flags, one run.

    python benchmarks/decode_throughput.py --model-path .device-site/models/llama3-8b-shape \
        --input-len 32768 --batch 16 --output-len 256 [--sparse-method dense --sparse-config '{}'] \
        [--vanilla-backend flashinfer|triton] [--sparse-base flashinfer|triton]

Runs longer than one 10-minute device command at 64K+ context: start it detached
(``setsid nohup python3 benchmarks/decode_throughput.py ... --log-dir /root/bench > /root/bench/out.txt &``)
and read ``/root/bench`` from later commands on the same warm machine.

Starts ``python -m sglang.launch_server --attention-backend <--vanilla-backend>`` (vanilla; FlashInfer
by default), sends ``--batch`` concurrent requests of ``--input-len`` random tokens (distinct prompts, no
prefix sharing) with ``--output-len`` forced output tokens, stops it, then does the same through
``python -m sgl_sparse.launch_server --attention-backend <--sparse-base>`` (ours wraps that stock backend;
``--sparse-method dense`` is the parity check).

Decode throughput comes from the server log (``--decode-log-interval 10``; ``SGLANG_LOG_MS=1`` for
millisecond timestamps). Its window is the full-batch decode with no prefill inside: the ``Decode batch``
lines with ``#running-req`` == batch that come after the last ``Prefill batch`` line, less the first of
them (its interval may include that last prefill). Reported: the median of those lines' ``gen
throughput``, the window (lines x interval = steps, its first and last timestamps, and the tok/s those
timestamps give), KV tokens in use, the bandwidth floor (the tok/s at which one decode step reads every
KV token in use plus all weights at ``--hbm-tbps``) and the % of it reached, the wall-clock output tok/s
of the whole run (batch x output-len / wall) and the prefill phase (from the first request sent to the
last ``Prefill batch`` line, which SGLang prints after that prefill ran).

``--profile-dir DIR`` also records ``--profile-steps`` decode steps with SGLang's torch profiler
(``/start_profile``, CPU and GPU) once the whole batch decodes; ``benchmarks/profile_summary.py``
summarises the trace. Profiled steps run slower: a profiled run is for diagnosis, not for the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_sparse.server_process import GPU_SERVER_FLAGS, ServerProcess  # noqa: E402

DECODE_LOG_INTERVAL = 10
BACKENDS = ("flashinfer", "triton")
# One log line: "[2026-11-30 11:53:54] msg" or, with SGLANG_LOG_MS=1, "[2026-11-30 11:53:54.123] msg"
# (a process prefix such as " TP0" may follow the time inside the brackets).
LINE_RE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)[^\]]*\]\s?(.*)$")
DECODE_RE = re.compile(
    r"Decode batch.*?#running-req: (\d+), #token: (\d+), token usage: ([\d.]+).*?"
    r"gen throughput \(token/s\): ([\d.]+)"
)
PREFILL_RE = re.compile(r"Prefill batch")
GPU_FLAGS = [
    *GPU_SERVER_FLAGS, "--mem-fraction-static", "0.80", "--context-length", "131072", "--load-format", "dummy",
    "--decode-log-interval", str(DECODE_LOG_INTERVAL),
]
SERVER_ENV = {"SGLANG_LOG_MS": "1"}


@dataclass
class Result:
    """One server's run. Fields after ``floor_tok_s`` came later: JSON files of older runs lack them."""

    server: str
    attention_backend: str = "?"  # as the server reports it (ours: the class that served)
    batch: int = 0
    decode_tok_s: float = 0.0  # median gen throughput over the window
    decode_steps_at_full_batch: int = 0  # steps in the window (older runs: every full-batch log line's steps)
    kv_tokens_in_use: int = 0
    kv_token_capacity: int = 0
    wall_s: float = 0.0
    floor_tok_s: float = 0.0
    config: str | None = None  # e.g. 'snapkv {"budget": 2048}'; vanilla: None
    attention_base: str | None = None  # the stock backend: vanilla's --attention-backend, or the one ours wraps
    input_len: int | None = None
    output_len: int | None = None
    decode_log_interval: int | None = None
    window_lines: int | None = None  # log lines in the window (x interval = decode_steps_at_full_batch)
    window_first_ts: str | None = None  # timestamp of the line just before the window: where its first step starts
    window_last_ts: str | None = None
    window_s: float | None = None
    window_tok_s: float | None = None  # batch x steps / window_s (None when the log has no timestamps)
    wall_output_tok_s: float | None = None  # batch x output_len / wall_s
    prefill_phase_s: float | None = None  # first request sent -> last Prefill batch line
    # the server's --mem-fraction-static: a method whose metadata needs more memory for the same batch
    # (Quest, RetroInfer at 6 x 130K) runs with more, and the tables say so
    mem_fraction_static: float | None = None


@dataclass
class DecodeWindow:
    lines: int
    interval: int
    steps: int
    median_tok_s: float
    kv_tokens_in_use: int
    first_ts: str | None  # timestamp of the dropped line (the window's steps start after it)
    last_ts: str | None
    window_s: float | None
    window_tok_s: float | None
    last_prefill_ts: str | None


def _parse_ts(ts: str | None) -> float | None:
    """A log timestamp (local time, as SGLang's logging writes it) as epoch seconds."""
    if ts is None:
        return None
    fmt = "%Y-%m-%d %H:%M:%S.%f" if "." in ts else "%Y-%m-%d %H:%M:%S"
    return datetime.strptime(ts, fmt).timestamp()


def decode_window(log_text: str, batch: int, interval: int = DECODE_LOG_INTERVAL) -> DecodeWindow:
    """The full-batch decode window of one server log (see the module docstring).

    "The last ``Prefill batch`` line" is the last one before the last full-batch ``Decode batch`` line,
    so prefills logged after the measured batch finished (none today) cannot empty the window.
    """
    events: list[tuple[str, str | None, re.Match[str] | None]] = []
    for raw in log_text.splitlines():
        m = LINE_RE.match(raw)
        ts, msg = (m.group(1), m.group(2)) if m else (None, raw)
        d = DECODE_RE.search(msg)
        if d:
            events.append(("decode", ts, d))
        elif PREFILL_RE.search(msg):
            events.append(("prefill", ts, None))
    full = [i for i, (kind, _, d) in enumerate(events) if kind == "decode" and d and int(d.group(1)) == batch]
    if not full:
        most = max((int(d.group(1)) for kind, _, d in events if kind == "decode" and d), default=0)
        hint = (f"; at most {most} ran together (the KV pool fits fewer: measure that batch with --sparse-batch "
                f"{most})" if 0 < most < batch else "")
        raise ValueError(f"no 'Decode batch' line with #running-req: {batch} in the log{hint}")
    last_prefill = max((i for i, (kind, _, _) in enumerate(events) if kind == "prefill" and i < full[-1]),
                       default=-1)
    after = [i for i in full if i > last_prefill]
    if len(after) < 2:
        raise ValueError(f"only {len(after)} full-batch 'Decode batch' line(s) after the last 'Prefill batch' "
                         f"line; need 2 (the first is dropped): use a longer --output-len")
    dropped, kept = after[0], after[1:]
    matches = [events[i][2] for i in kept]
    assert all(m is not None for m in matches)
    tput = statistics.median(float(m.group(4)) for m in matches if m)
    kv = max(int(m.group(2)) for m in matches if m)
    steps = len(kept) * interval
    first_ts, last_ts = events[dropped][1], events[kept[-1]][1]
    t0, t1 = _parse_ts(first_ts), _parse_ts(last_ts)
    window_s = t1 - t0 if t0 is not None and t1 is not None else None
    window_tok_s = batch * steps / window_s if window_s else None
    last_prefill_ts = events[last_prefill][1] if last_prefill >= 0 else None
    return DecodeWindow(len(kept), interval, steps, tput, kv, first_ts, last_ts, window_s, window_tok_s,
                        last_prefill_ts)


def model_bytes(cfg: dict, dtype_bytes: int = 2) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of a Llama-shaped config."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    per_layer = h * heads * hd * 2 + h * kv_heads * hd * 2 + 3 * h * inter + 2 * h
    params = layers * per_layer + 2 * cfg["vocab_size"] * h + h
    return params * dtype_bytes, layers * kv_heads * hd * 2 * dtype_bytes


def floor_tok_s(batch: int, weight_bytes: int, kv_bytes_per_token: int, kv_tokens: int, hbm_tbps: float,
                kv_step_bytes: int | None = None) -> float:
    """Decode tok/s at which a step reads the weights plus every KV token in use (``kv_step_bytes``: what the
    step reads of the KV instead, for a method that reads part of it)."""
    kv = kv_tokens * kv_bytes_per_token if kv_step_bytes is None else kv_step_bytes
    return batch / ((weight_bytes + kv) / (hbm_tbps * 1e12))


def selection_kv_bytes(method: str, config: dict, cfg: dict, batch: int, kv_tokens: int,
                       dtype_bytes: int = 2) -> int | None:
    """KV bytes one decode step of a dynamic selection method reads (all layers), from its config and the KV in
    use (``kv_tokens`` over ``batch`` equal requests); ``None`` for a method not modelled here. Quest: its dense
    layers read everything, each selecting layer its ``token_budget`` tokens and every page's key min and max (a
    page's summary is one token's K+V in size). OmniKV: the layers up to its first filter layer and the filter
    layers read everything, the filter layers K once more to score, the others ``token_budget`` tokens.
    RetroInfer: per selecting layer every usable cluster's centroid (and size) to rank, the estimated clusters'
    centroids and value sums, and exactly the sink, the unclustered tail and the retrieved clusters' members
    (clusters of ``cluster_size`` tokens on average); a request under ``min_index_tokens`` reads everything."""
    layers = cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_tok_layer = cfg["num_key_value_heads"] * hd * 2 * dtype_bytes  # K and V of one token in one layer
    per_req = kv_tokens / max(batch, 1)
    budget = batch * min(int(config.get("token_budget", 0)), per_req)
    if method == "quest":
        dense = int(config["dense_layers"])
        pages = batch * -(-per_req // int(config["page_size"]))
        return int(dense * kv_tokens * per_tok_layer + (layers - dense) * (budget + pages) * per_tok_layer)
    if method == "omnikv":
        from sgl_sparse.methods.selection.omnikv import parse_filter_layers

        filters = parse_filter_layers(str(config["filter_layers"]), layers)
        full = min(filters) + len(filters)
        return int(full * kv_tokens * per_tok_layer + len(filters) * kv_tokens * per_tok_layer // 2
                   + (layers - full) * budget * per_tok_layer)
    if method == "retroinfer":
        import torch

        from sgl_sparse.config import build_config
        from sgl_sparse.methods.selection.retroinfer import RetroInferConfig

        conf = build_config(RetroInferConfig, config)
        lay = conf.layout()
        n = int(per_req)
        nseg = int(lay.num_segments(torch.tensor([n]))[0])
        if not nseg:
            return int(kv_tokens * per_tok_layer * layers)
        c = nseg * lay.clusters_per_segment
        r, e = (int(x[0]) for x in lay.budgets(torch.tensor([c])))
        head_vec = cfg["num_key_value_heads"] * hd * dtype_bytes  # one centroid or value sum, every KV head
        exact = (n - nseg * lay.seg) + r * lay.page  # sink + tail + retrieved members
        per_layer = c * (head_vec + 4 * cfg["num_key_value_heads"]) + e * 2 * head_vec + exact * per_tok_layer
        dense = conf.dense_layers
        return int(batch * (dense * n * per_tok_layer + (layers - dense) * per_layer))
    return None


def prompt_vocab(model_dir: Path, model_vocab: int) -> int:
    """Random prompt ids stay inside the tokenizer's vocabulary (the shape-only models ship a small one)."""
    tok = model_dir / "tokenizer.json"
    if tok.exists():
        return min(model_vocab, len(json.loads(tok.read_text())["model"]["vocab"]))
    return model_vocab


def run_one(name: str, module: str, args: argparse.Namespace, extra: list[str], batch: int,
            base: str, config: str | None) -> Result:
    cfg = json.loads((Path(args.model_path) / "config.json").read_text())
    weight_b, kv_b = model_bytes(cfg)
    rng = random.Random(args.seed)
    vocab = prompt_vocab(Path(args.model_path), cfg["vocab_size"])
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(batch)]
    # --max-running-requests must not cap the batch (a value equal to the batch admitted one fewer).
    flags = [*GPU_FLAGS, "--cuda-graph-max-bs", str(max(32, batch)), "--max-running-requests", str(batch + 8),
             "--attention-backend", base, *extra]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    log = Path(args.log_dir) / f"{name.replace(':', '-')}.log"
    with ServerProcess(args.model_path, flags, module=module, startup_timeout=600, log_path=str(log),
                       env=SERVER_ENV) as srv:
        t0_epoch, t0 = time.time(), time.monotonic()
        if args.profile_dir:
            threading.Thread(target=_profile_when_full, args=(srv, log, batch, name, args), daemon=True).start()
        with ThreadPoolExecutor(batch) as pool:
            outs = list(pool.map(lambda ids: srv.generate(input_ids=ids, max_new_tokens=args.output_len,
                                                          ignore_eos=True, timeout=args.request_timeout), prompts))
        wall = time.monotonic() - t0
        info = srv.server_info()
        capacity = int(info["max_total_num_tokens"])
        ours = info["internal_states"][0].get("sgl_sparse")
        backend = ours["attention_backend_class"] if ours else info["attention_backend"]
        if ours:
            base = ours.get("attention_base") or base
            # A method-owned KV layout (quantization): a step reads its bytes per token, not bf16's.
            kv_b = int((ours.get("kv_store") or {}).get("bytes_per_token", kv_b))
    assert all(len(o["output_ids"]) == args.output_len for o in outs)
    try:
        w = decode_window(log.read_text(errors="replace"), batch)
    except ValueError as e:
        raise RuntimeError(f"{name}: {e}; see {log}") from e
    floor = floor_tok_s(batch, weight_b, kv_b, w.kv_tokens_in_use, args.hbm_tbps)
    if ours and ours.get("family") == "selection":
        read = selection_kv_bytes(ours["method"], ours.get("config") or {}, cfg, batch, w.kv_tokens_in_use)
        floor = floor_tok_s(batch, weight_b, kv_b, w.kv_tokens_in_use, args.hbm_tbps, read) if read else 0.0
    last_prefill = _parse_ts(w.last_prefill_ts)
    return Result(
        name, backend, batch, w.median_tok_s, w.steps, w.kv_tokens_in_use, capacity, wall, floor,
        config=config, attention_base=base, input_len=args.input_len, output_len=args.output_len,
        decode_log_interval=w.interval, window_lines=w.lines, window_first_ts=w.first_ts,
        window_last_ts=w.last_ts, window_s=w.window_s, window_tok_s=w.window_tok_s,
        wall_output_tok_s=batch * args.output_len / wall if wall > 0 else None,
        prefill_phase_s=last_prefill - t0_epoch if last_prefill is not None else None,
        mem_fraction_static=info.get("mem_fraction_static"),
    )


def _profile_when_full(srv: ServerProcess, log: Path, batch: int, name: str, args: argparse.Namespace) -> None:
    """Start SGLang's profiler at the third full-batch decode log line (the whole batch decoding)."""
    import requests

    deadline = time.monotonic() + args.request_timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        full = [m for m in DECODE_RE.finditer(text) if int(m.group(1)) == batch]
        if len(full) >= 3:
            out = Path(args.profile_dir).resolve() / name.replace(":", "-")
            out.mkdir(parents=True, exist_ok=True)
            r = requests.post(f"{srv.base_url}/start_profile", json={
                "output_dir": str(out), "num_steps": args.profile_steps, "activities": ["CPU", "GPU"],
                "profile_prefix": name.replace(":", "-"),
                # SGLang records Python stacks and shapes by default: that slows the host and makes
                # the GPU look idler than it is. Off unless --profile-stack.
                "with_stack": args.profile_stack, "record_shapes": args.profile_stack}, timeout=120)
            print(f"{name}: profiling {args.profile_steps} decode steps into {out}: HTTP {r.status_code}", flush=True)
            return
        time.sleep(0.5)


def load_results(path: str | Path) -> list[Result]:
    """Rows of a ``--json`` file; unknown keys are ignored, missing ones take their defaults."""
    names = {f.name for f in dataclasses.fields(Result)}
    return [Result(**{k: v for k, v in r.items() if k in names}) for r in json.loads(Path(path).read_text())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=False)
    p.add_argument("--input-len", type=int, default=32768)
    # Long enough that every request decodes together for a while: prefills are staggered.
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="concurrent requests for vanilla")
    p.add_argument("--sparse-batch", type=int, default=None, help="concurrent requests for ours (default: --batch)")
    p.add_argument("--sparse-method", default="dense", help="dense (parity with vanilla), snapkv, h2o, rkv, ...")
    p.add_argument("--sparse-config", default="{}")
    p.add_argument("--sparse-server-args", default="",
                   help="more flags for our server only, one string (e.g. '--cuda-graph-backend-decode disabled', "
                        "which methods observing decode queries need on GPU: h2o, rkv, skipkv)")
    p.add_argument("--vanilla-backend", choices=BACKENDS, default="flashinfer",
                   help="vanilla's --attention-backend (default flashinfer, the fastest on the H200)")
    p.add_argument("--sparse-base", choices=BACKENDS, default="flashinfer",
                   help="the stock backend ours wraps, passed to it as --attention-backend")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds; long prompts at large batch queue behind each other's prefill")
    p.add_argument("--hbm-tbps", type=float, default=4.3, help="measured device-to-device copy rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=".")
    p.add_argument("--json", default=None, help="write results here too")
    p.add_argument("--only", choices=["vanilla", "sgl_sparse"], default=None)
    p.add_argument("--profile-dir", default=None, help="record decode steps with the torch profiler (diagnosis)")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--profile-stack", action="store_true",
                   help="also record Python stacks (host code by function; slows the host)")
    p.add_argument("--table-from", nargs="+", default=None, metavar="JSON",
                   help="print the tables from the --json files of earlier runs (the baseline is the first "
                        "vanilla row, else the first row), e.g. vanilla and ours run at once on two GPUs of one "
                        "host with --only")
    args = p.parse_args()

    if args.table_from:
        print_tables([r for f in args.table_from for r in load_results(f)])
        return
    if not args.model_path:
        p.error("--model-path is required (except with --table-from)")
    results: list[Result] = []

    def record(r: Result) -> None:
        results.append(r)
        if args.json:  # after each server, so a later failure keeps what was measured
            Path(args.json).write_text(json.dumps([asdict(x) for x in results], indent=2))

    if args.only in (None, "vanilla"):
        record(run_one("vanilla", "sglang.launch_server", args, [], args.batch, args.vanilla_backend, None))
    if args.only in (None, "sgl_sparse"):
        extra = ["--sparse-method", args.sparse_method, "--sparse-config", args.sparse_config,
                 *shlex.split(args.sparse_server_args)]
        record(run_one(f"sgl_sparse:{args.sparse_method}", "sgl_sparse.launch_server", args, extra,
                       args.sparse_batch or args.batch, args.sparse_base,
                       f"{args.sparse_method} {args.sparse_config}"))

    print(f"\ninput {args.input_len}, output {args.output_len}, model {args.model_path}, "
          f"method {args.sparse_method} {args.sparse_config}")
    print_tables(results)


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(r: Result) -> str:
    return f"{100 * r.decode_tok_s / r.floor_tok_s:.0f}%" if r.floor_tok_s else "-"


def _config(r: Result) -> str:
    label = r.config or r.server
    if r.input_len is not None:
        label += f", {r.input_len} in / {r.output_len} out"
    return label


def _is_vanilla(r: Result) -> bool:
    return r.server.startswith("vanilla")


def _pairs(results: list[Result]) -> list[tuple[Result, Result]]:
    """(ours, vanilla) pairs: each sgl_sparse row against the vanilla row of its run (the last one before it,
    else the first one after it, as when ``--table-from`` gets ours' file first); without any vanilla row,
    against the first row, and none for the first row itself (an ``--only sgl_sparse`` run: no table, where it
    used to compare the run with itself, ratio 1.000)."""
    vanillas = [r for r in results if _is_vanilla(r)]
    pairs, last = [], None
    for r in results:
        if _is_vanilla(r):
            last = r
            continue
        base = last or next((v for v in vanillas if results.index(v) > results.index(r)), None) or results[0]
        if base is not r:
            pairs.append((r, base))
    if not pairs and len(results) > 1:  # vanilla rows only: each against the first
        pairs = [(r, results[0]) for r in results[1:]]
    return pairs


def comparison_table(results: list[Result]) -> str:
    """One row per sgl_sparse run: ours against vanilla of the same run, the floors, the wall clock."""
    lines = [
        "| config | batch ours / vanilla | ours decode tok/s | vanilla decode tok/s (backend) | ratio "
        "| ours floor tok/s (% of floor) | vanilla floor tok/s (% of floor) | wall s ours / vanilla "
        "| wall output tok/s ours / vanilla |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r, base in _pairs(results):
        ratio = r.decode_tok_s / base.decode_tok_s if base.decode_tok_s else float("nan")
        vbackend = base.attention_base or base.attention_backend
        # ours given more memory than its vanilla (Quest / RetroInfer at vanilla's batch) says so beside its config
        mem = _mem(r) if r.mem_fraction_static != base.mem_fraction_static else ""
        lines.append(
            f"| {_config(r)}{mem} | {r.batch} / {base.batch} | {r.decode_tok_s:.1f} | {base.decode_tok_s:.1f} "
            f"({vbackend}) | {ratio:.3f} | {r.floor_tok_s:.0f} ({_pct(r)}) | {base.floor_tok_s:.0f} ({_pct(base)}) | "
            f"{r.wall_s:.1f} / {base.wall_s:.1f} | {_f(r.wall_output_tok_s)} / {_f(base.wall_output_tok_s)} |")
    return "\n".join(lines)


def detail_table(results: list[Result]) -> str:
    """Every server: the decode window it was measured over, KV, floor, prefill phase and wall clock."""
    lines = [
        "| server | attention backend (base) | batch | decode tok/s (median) | window: lines x interval = steps "
        "| window first -> last step | window tok/s (timestamps) | KV tokens in use | floor tok/s | % of floor "
        "| prefill phase s | wall s | wall output tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    vanilla_mem = {r.mem_fraction_static for r in results if r.server == "vanilla"}
    for r in results:
        # the memory fraction where it differs from vanilla's in these results (or there is no vanilla row)
        mem = _mem(r) if r.mem_fraction_static not in vanilla_mem or not vanilla_mem else ""
        if r.window_lines is not None:
            window = f"{r.window_lines} x {r.decode_log_interval} = {r.decode_steps_at_full_batch}"
        else:
            window = f"{r.decode_steps_at_full_batch} full-batch log lines (older run: no window)"
        span = (f"{r.window_first_ts} -> {r.window_last_ts} ({_f(r.window_s, '.2f')} s)"
                if r.window_first_ts or r.window_last_ts else "-")
        backend = r.attention_backend + (f" ({r.attention_base})" if r.attention_base else "")
        lines.append(
            f"| {r.server} | {backend} | {r.batch} | {r.decode_tok_s:.1f} | {window} | {span} | "
            f"{_f(r.window_tok_s)} | {r.kv_tokens_in_use} of {r.kv_token_capacity}{mem} | {r.floor_tok_s:.0f} | "
            f"{_pct(r)} | {_f(r.prefill_phase_s)} | {r.wall_s:.1f} | {_f(r.wall_output_tok_s)} |")
    return "\n".join(lines)


def _mem(r: Result) -> str:
    return "" if r.mem_fraction_static is None else f" (mem {r.mem_fraction_static:g})"


def print_tables(results: list[Result]) -> None:
    table = comparison_table(results)
    if table.count("\n") > 1:  # has a row: at least one pair
        print(table)
        print()
    print(detail_table(results))


if __name__ == "__main__":
    main()
