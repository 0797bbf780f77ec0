"""Decode throughput: vanilla SGLang vs sgl_sparse, same GPU, same flags, one run.

    python benchmarks/decode_throughput.py --model-path .device-site/models/llama3-8b-shape \
        --input-len 32768 --batch 16 --output-len 256 [--sparse-method dense --sparse-config '{}']

Runs longer than one 10-minute device command at 64K+ context: start it detached
(``setsid nohup python3 benchmarks/decode_throughput.py ... --log-dir /root/bench > /root/bench/out.txt &``)
and read ``/root/bench`` from later commands on the same warm machine.

Starts ``python -m sglang.launch_server`` (vanilla), sends ``--batch`` concurrent requests of
``--input-len`` random tokens (distinct prompts, no prefix sharing) with ``--output-len`` forced
output tokens, stops it, then does the same through ``python -m sgl_sparse.launch_server``. Decode
throughput is what the server logs (``Decode batch ... gen throughput (token/s)``, prefill excluded),
median over the steps where the whole batch decodes. Prints a table with the bandwidth floor: the
tok/s at which one decode step reads every KV token in use plus all weights at ``--hbm-tbps``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_sparse.server_process import GPU_SERVER_FLAGS, ServerProcess  # noqa: E402

DECODE_RE = re.compile(
    r"Decode batch.*?#running-req: (\d+), #token: (\d+), token usage: ([\d.]+).*?"
    r"gen throughput \(token/s\): ([\d.]+)"
)
GPU_FLAGS = [
    *GPU_SERVER_FLAGS, "--mem-fraction-static", "0.80", "--context-length", "131072", "--load-format", "dummy",
    "--decode-log-interval", "10",
]


@dataclass
class Result:
    server: str
    attention_backend: str  # as the server reports it (ours: the class that served)
    batch: int
    decode_tok_s: float
    decode_steps_at_full_batch: int
    kv_tokens_in_use: int
    kv_token_capacity: int
    wall_s: float
    floor_tok_s: float


def model_bytes(cfg: dict, dtype_bytes: int = 2) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of a Llama-shaped config."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    per_layer = h * heads * hd * 2 + h * kv_heads * hd * 2 + 3 * h * inter + 2 * h
    params = layers * per_layer + 2 * cfg["vocab_size"] * h + h
    return params * dtype_bytes, layers * kv_heads * hd * 2 * dtype_bytes


def prompt_vocab(model_dir: Path, model_vocab: int) -> int:
    """Random prompt ids stay inside the tokenizer's vocabulary (the shape-only models ship a small one)."""
    tok = model_dir / "tokenizer.json"
    if tok.exists():
        return min(model_vocab, len(json.loads(tok.read_text())["model"]["vocab"]))
    return model_vocab


def run_one(name: str, module: str, args: argparse.Namespace, extra: list[str], batch: int) -> Result:
    cfg = json.loads((Path(args.model_path) / "config.json").read_text())
    weight_b, kv_b = model_bytes(cfg)
    rng = random.Random(args.seed)
    vocab = prompt_vocab(Path(args.model_path), cfg["vocab_size"])
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(batch)]
    # --max-running-requests must not cap the batch (a value equal to the batch admitted one fewer).
    flags = [*GPU_FLAGS, "--cuda-graph-max-bs", str(max(32, batch)), "--max-running-requests", str(batch + 8),
             *extra]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    log = Path(args.log_dir) / f"{name.replace(':', '-')}.log"
    with ServerProcess(args.model_path, flags, module=module, startup_timeout=600, log_path=str(log)) as srv:
        t0 = time.monotonic()
        with ThreadPoolExecutor(batch) as pool:
            outs = list(pool.map(lambda ids: srv.generate(input_ids=ids, max_new_tokens=args.output_len,
                                                          ignore_eos=True, timeout=args.request_timeout), prompts))
        wall = time.monotonic() - t0
        info = srv.server_info()
        capacity = int(info["max_total_num_tokens"])
        ours = info["internal_states"][0].get("sgl_sparse")
        backend = ours["attention_backend_class"] if ours else info["attention_backend"]
    assert all(len(o["output_ids"]) == args.output_len for o in outs)
    steps = [m for m in DECODE_RE.finditer(log.read_text()) if int(m.group(1)) == batch]
    if not steps:
        raise RuntimeError(f"{name}: no decode step ran the whole batch of {batch}; see {log}")
    tput = statistics.median(float(m.group(4)) for m in steps)
    kv_in_use = max(int(m.group(2)) for m in steps)
    step_bytes = weight_b + kv_in_use * kv_b
    floor = batch / (step_bytes / (args.hbm_tbps * 1e12))
    return Result(name, backend, batch, tput, len(steps), kv_in_use, capacity, wall, floor)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=False)
    p.add_argument("--input-len", type=int, default=32768)
    # Long enough that every request decodes together for a while: prefills are staggered.
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="concurrent requests for vanilla")
    p.add_argument("--sparse-batch", type=int, default=None, help="concurrent requests for ours (default: --batch)")
    p.add_argument("--sparse-method", default="dense")
    p.add_argument("--sparse-config", default="{}")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds; long prompts at large batch queue behind each other's prefill")
    p.add_argument("--hbm-tbps", type=float, default=4.3, help="measured device-to-device copy rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=".")
    p.add_argument("--json", default=None, help="write results here too")
    p.add_argument("--only", choices=["vanilla", "sgl_sparse"], default=None)
    p.add_argument("--table-from", nargs="+", default=None, metavar="JSON",
                   help="print one table from the --json files of earlier runs (the first row is the baseline), "
                        "e.g. vanilla and ours run at once on two GPUs of one host with --only")
    args = p.parse_args()

    if args.table_from:
        rows = [Result(**r) for f in args.table_from for r in json.loads(Path(f).read_text())]
        print_table(rows)
        return
    if not args.model_path:
        p.error("--model-path is required (except with --table-from)")
    results: list[Result] = []

    def record(r: Result) -> None:
        results.append(r)
        if args.json:  # after each server, so a later failure keeps what was measured
            Path(args.json).write_text(json.dumps([asdict(x) for x in results], indent=2))

    if args.only in (None, "vanilla"):
        record(run_one("vanilla", "sglang.launch_server", args, ["--attention-backend", "triton"], args.batch))
    if args.only in (None, "sgl_sparse"):
        extra = ["--sparse-method", args.sparse_method, "--sparse-config", args.sparse_config]
        record(run_one(f"sgl_sparse:{args.sparse_method}", "sgl_sparse.launch_server", args, extra,
                       args.sparse_batch or args.batch))

    print(f"\ninput {args.input_len}, output {args.output_len}, model {args.model_path}, "
          f"method {args.sparse_method} {args.sparse_config}")
    print_table(results)


def print_table(results: list[Result]) -> None:
    print("| server | attention backend | batch | decode tok/s | ratio vs vanilla | KV tokens in use "
          "| floor tok/s | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = results[0].decode_tok_s
    for r in results:
        print(f"| {r.server} | {r.attention_backend} | {r.batch} | {r.decode_tok_s:.1f} | "
              f"{r.decode_tok_s / base:.3f} | {r.kv_tokens_in_use} of {r.kv_token_capacity} | "
              f"{r.floor_tok_s:.0f} | {r.wall_s:.1f} |")


if __name__ == "__main__":
    main()
