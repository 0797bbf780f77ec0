"""The quality table of one model: the task suite through our server, per method and prompt size.

    python benchmarks/quality_suite.py --model-dir sgl_sparse/assets/quality-small --tokens 2048 --n 50 \
        --methods dense 'snapkv:{"budget": 512}' 'streamingllm:{"sink_tokens": 64, "recent_tokens": 448}'
    python3 benchmarks/quality_suite.py --device cuda --model-dir /root/train/large --tokens 2048 16384 ...

One server per method (``python -m sgl_sparse.launch_server``), every size through it, greedy. Rows:
each task, the agent task again as a multi-turn Chain Cache session, and the mean over the tasks
(single prompts). Columns: method @ tokens. ``--json`` keeps the per-task detail (failures included).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_sparse.quality.eval import (  # noqa: E402
    MAX_NEW_TOKENS,
    build_items,
    default_workers,
    evaluate,
    positive_int,
    render,
)
from sgl_sparse.quality.tasks import TASKS  # noqa: E402
from sgl_sparse.server_process import CPU_SERVER_FLAGS, GPU_SERVER_FLAGS, ServerProcess  # noqa: E402

CPU_FLAGS = [*CPU_SERVER_FLAGS, "--max-total-tokens", "32768", "--chunked-prefill-size", "2048"]
GPU_FLAGS = [*GPU_SERVER_FLAGS, "--mem-fraction-static", "0.5"]
CHAIN_ROW = "agent_recall, Chain Cache session (--chain)"


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME:JSON`` (the JSON is the method's --sparse-config)."""
    name, _, cfg = spec.partition(":")
    try:
        config = json.loads(cfg) if cfg else {}
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"method {spec!r}: the config after ':' is not JSON ({e})") from e
    if not name or not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"method {spec!r}: expected NAME or NAME:{{json object}}")
    return name, config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="sgl_sparse/assets/quality-small")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048], help="prompt sizes")
    p.add_argument("--n", type=int, default=50, help="examples per task")
    p.add_argument("--methods", type=parse_method, nargs="+", default=[("dense", {})],
                   help="NAME or NAME:JSON, e.g. 'snapkv:{\"budget\": 512}'")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--no-chain", action="store_true", help="skip the multi-turn agent session")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    p.add_argument("--workers", type=positive_int, default=default_workers(),
                   help="processes that size the prompts (default: this machine's cores)")
    p.add_argument("--parallel", type=positive_int, default=4, help="requests in flight at once")
    p.add_argument("--server-args", default="",
                   help="more server flags as one string, appended to the defaults; write it with '=' "
                        "(--server-args=--disable-cuda-graph): argparse takes a lone '--flag' for an option")
    args = p.parse_args()
    extra = shlex.split(args.server_args)

    from transformers import AutoTokenizer

    limit = json.loads((Path(args.model_dir) / "config.json").read_text())["max_position_embeddings"]
    if max(args.tokens) > limit:
        p.error(f"--tokens {max(args.tokens)} exceeds the model's context ({limit}, max_position_embeddings)")
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    items = {t: build_items(tok, list(TASKS), args.n, t, 10_000, chain=False, workers=args.workers)
             for t in args.tokens}
    # The same fitted agent examples, sent turn by turn.
    chained = {} if args.no_chain else {t: [render(it.example, tok, chain=True) for it in items[t]
                                            if it.example.task == "agent_recall"] for t in args.tokens}
    flags = CPU_FLAGS if args.device == "cpu" else GPU_FLAGS
    results: dict[str, dict[str, Any]] = {}
    for i, (name, config) in enumerate(args.methods):
        log = str(Path(args.log_dir) / f"server-{i}-{name}.log") if args.log_dir else None  # a name may repeat
        label = name + (f" {json.dumps(config)}" if config else "")
        sparse = ["--sparse-method", name, "--sparse-config", json.dumps(config)]
        with ServerProcess(args.model_dir, [*flags, *sparse, *extra], startup_timeout=600, log_path=log) as srv:
            for t in args.tokens:
                col = f"{label} @ {t}"
                # Each result is printed (and the JSON rewritten) as soon as it exists, so a run cut
                # short (a device time limit) still leaves what it measured.
                results[col] = table = evaluate(srv.base_url, items[t], args.parallel)
                print(f"{col}: {json.dumps({k: round(v['accuracy'], 3) for k, v in table.items()})}", flush=True)
                if chained:
                    table[CHAIN_ROW] = evaluate(srv.base_url, chained[t], args.parallel)["agent_recall"]
                    print(f"{col}, {CHAIN_ROW}: {table[CHAIN_ROW]['accuracy']:.3f}", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=2))
    rows = [*TASKS, *([CHAIN_ROW] if chained else [])]
    print(f"\nmodel {args.model_dir}, {args.n} examples per task, greedy, up to {MAX_NEW_TOKENS} new tokens")
    print("| task | " + " | ".join(f"`{c}`" for c in results) + " |")
    print("| --- |" + " --- |" * len(results))
    for r in rows:
        print(f"| {r} | " + " | ".join(f"{results[c][r]['accuracy']:.2f}" for c in results) + " |")
    means = [statistics.mean(results[c][t]["accuracy"] for t in TASKS) for c in results]
    print("| all tasks (single prompts) | " + " | ".join(f"{m:.2f}" for m in means) + " |")


if __name__ == "__main__":
    main()
