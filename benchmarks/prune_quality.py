"""Quality of a request's own prune when the fact asked for sits in the pruned history (issue: Prefix-Cache Pruning).

    python benchmarks/prune_quality.py --tokens 2048 --n 50 --keep-ratios 0.05 0.1 0.25 --json out.json

The agent task (``agent_recall``: a transcript of tool results, each carrying one fact; the last user turn asks for
one of the facts of the earlier tool results) through one server of ours (``--sparse-request-methods eviction``,
the trained small model by default). Each request prunes the content of its tool messages but the most recent one
(``--lag``, default 1: the asked fact is always in a pruned message) with ``custom_params`` ``sgl_sparse_prune``
(ranges found as ``{"roles": ["tool"], "lag": n}`` would find them); ``--fact-in spared`` spares the asked fact's
message instead (the others are pruned: what pruning costs a question about a turn it left alone). Under each
policy:

* ``none``: no prune (the dense answer);
* ``drop``: the ranges leave whole;
* ``knorm@r`` / ``snapkv_global@r`` / ``kvzip_global@r``: a fraction ``r`` of the ranges' tokens stays, those of
  lowest key norm, those the prompt's last 32 queries (which hold the question) attend to most, or those KVzip's
  reconstruction of the ranges attends to most (docs/prefix-cache-pruning.md). ``--policies`` picks them.
  ``kvzip_global``'s replays run after the prompt, so the server's context must hold prompt + replay
  (``--context-length``, default ``--tokens`` + 64: a replay then shrinks to the room left; give e.g. 4096).

The prune comes after the prompt's forward, so the first answer token still sees every position; the tokens after
it (a multi-digit port) read only what is left, as every later turn of the conversation would. Greedy, 24 new
tokens, scored by the suite's scorer. Prints one row per policy: accuracy, the tokens pruned (ranges' size) and
kept per request.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_sparse.prune.body import message_spans, role_ranges  # noqa: E402
from sgl_sparse.quality.eval import MAX_NEW_TOKENS, fit_example, positive_int, render  # noqa: E402
from sgl_sparse.quality.tasks import score  # noqa: E402
from sgl_sparse.server_process import CPU_SERVER_FLAGS, GPU_SERVER_FLAGS, ServerProcess  # noqa: E402

POLICIES = ("drop", "knorm", "snapkv_global", "kvzip_global")


def ranges_of(example: Any, tokenizer: Any, lag: int, fact_in: str = "pruned") -> list[list[int]]:
    """The content spans of the example's tool messages but the ``lag`` most recent, in the ids ``render`` sends
    (the same text template, tokenized without special tokens). ``fact_in="spared"``: of those, not the one that
    holds the asked fact (so every other tool result is pruned and the fact stays whole)."""
    def ids(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    messages = example.messages
    spans = message_spans(ids, messages)
    ranges = role_ranges(spans, messages, ["tool"], lag)
    if fact_in == "spared":
        fact = f"is {example.answer}."
        holding = [spans[i] for i, m in enumerate(messages) if m["role"] == "tool" and fact in m["content"]]
        if len(holding) != 1:
            raise ValueError(f"expected one tool message holding {fact!r}, found {len(holding)}")
        ranges = [r for r in ranges if r != holding[0]]
    return [list(r) for r in ranges]


def run(url: str, ids: list[int], prune: dict[str, Any] | None) -> str:
    sp: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
    if prune is not None:
        sp["custom_params"] = {"sgl_sparse_prune": json.dumps(prune)}
    r = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=600)
    r.raise_for_status()
    return str(r.json()["text"])


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from sgl_sparse.quality.models import small_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="default: the shipped small model")
    p.add_argument("--tokens", type=positive_int, default=2048)
    p.add_argument("--n", type=positive_int, default=50)
    p.add_argument("--seed", type=int, default=10_000)
    p.add_argument("--lag", type=int, default=1)
    p.add_argument("--fact-in", choices=["pruned", "spared"], default="pruned",
                   help="pruned: the asked fact's tool message is among the pruned (lag 1 guarantees it); spared: "
                        "every other tool message but the lag most recent is pruned, the fact's is not")
    p.add_argument("--keep-ratios", type=float, nargs="+", default=[0.05, 0.1, 0.25])
    p.add_argument("--policies", nargs="+", choices=POLICIES[1:], default=["knorm", "snapkv_global"],
                   help="the scored policies to run at each keep ratio (none and drop always run); kvzip_global "
                        "needs --context-length and a CPU server")
    p.add_argument("--context-length", type=positive_int, default=None,
                   help="the server's (default --tokens + 64); kvzip_global's replays need room after the prompt")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--parallel", type=positive_int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.lag < 0:
        p.error("--lag must be >= 0")
    if not all(0 < r < 1 for r in args.keep_ratios):
        p.error("--keep-ratios: each in (0, 1)")
    if "kvzip_global" in args.policies and not args.context_length:
        p.error("--policies kvzip_global: give --context-length, room for a replay of the pruned tokens after the "
                "prompt (e.g. 2 x --tokens); without it each replay shrinks to what --tokens + 64 leaves")
    if "kvzip_global" in args.policies and args.device != "cpu":
        p.error("--policies kvzip_global: its replay forwards are served on CPU servers only for now")
    model = args.model_dir or str(small_model_path())
    tok = AutoTokenizer.from_pretrained(model)
    items = []
    for i in range(args.n):
        ex = fit_example("agent_recall", args.seed + i, tok, args.tokens)
        items.append((ex, render(ex, tok, chain=False).turns[0], ranges_of(ex, tok, args.lag, args.fact_in)))
    conditions: list[tuple[str, dict[str, Any] | None]] = [("none", None)]
    conditions += [("drop", {"policy": "drop"})]
    conditions += [(f"{pol}@{r:g}", {"policy": pol, "keep_ratio": r}) for r in args.keep_ratios
                   for pol in args.policies]
    flags = [*(CPU_SERVER_FLAGS if args.device == "cpu" else GPU_SERVER_FLAGS), "--sparse-request-methods",
             "eviction", "--context-length", str(args.context_length or args.tokens + 64)]
    rows = []
    with ServerProcess(model, flags, startup_timeout=900) as server:
        for name, keep in conditions:
            def one(item: tuple[Any, list[int], list[list[int]]], keep: dict[str, Any] | None = keep) -> bool:
                ex, ids, ranges = item
                prune = None if keep is None else {"ranges": ranges, **keep}
                return score(ex, run(server.base_url, ids, prune))

            with ThreadPoolExecutor(args.parallel) as pool:
                ok = list(pool.map(one, items))
            size = sum(sum(hi - lo for lo, hi in r) for _, _, r in items) / len(items)
            kept = 0.0 if keep is None or "keep_ratio" not in keep else \
                sum(int(keep["keep_ratio"] * sum(hi - lo for lo, hi in r)) for _, _, r in items) / len(items)
            rows.append({"policy": name, "accuracy": sum(ok) / len(ok), "n": len(ok),
                         "pruned_tokens_mean": 0.0 if keep is None else size, "kept_tokens_mean": kept,
                         "prompt_tokens_mean": sum(len(ids) for _, ids, _ in items) / len(items)})
            print(f"{name}: {rows[-1]['accuracy']:.2f}", file=sys.stderr, flush=True)
    where = "in a pruned tool message" if args.fact_in == "pruned" else "in a spared tool message, every other pruned"
    print(f"agent_recall, {args.tokens} tokens, n={args.n}, lag {args.lag} (the asked fact is {where}), "
          f"model {Path(model).name}")
    print("| policy | accuracy | tokens in the pruned ranges (mean) | kept of them (mean) | prompt tokens (mean) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['policy']} | {r['accuracy']:.2f} | {r['pruned_tokens_mean']:.0f} | {r['kept_tokens_mean']:.0f} "
              f"| {r['prompt_tokens_mean']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
