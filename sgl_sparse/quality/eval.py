"""Run the task suite through a running server (ours with any method, or vanilla SGLang).

    python -m sgl_sparse.quality.eval --url http://127.0.0.1:30000 --model-dir MODEL_DIR \
        [--tokens 2048] [--n 20] [--tasks niah_single,...] [--baseline-url URL] [--chain] [--json OUT]

Greedy ``/generate`` per example; the prompt is sized to ``--tokens`` with the model's tokenizer.
``--chain`` sends the agent task turn by turn (each turn a request that extends the previous one),
so a Chain Cache server answers the final question from the compacted KV of earlier turns.
``--baseline-url`` runs the same examples against a second server (e.g. ``dense``) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests

from sgl_sparse.quality.tasks import TASKS, Example, make_example, score

MAX_NEW_TOKENS = 24


@dataclass
class Rendered:
    example: Example
    turns: list[list[int]]  # token ids of each request (one for single prompts; several with --chain)


def render(example: Example, tokenizer: Any, chain: bool) -> Rendered:
    if example.messages is None:
        assert example.prompt is not None
        return Rendered(example, [tokenizer.encode(example.prompt, add_special_tokens=True)])
    def ids(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    if not chain:
        return Rendered(example, [ids(example.messages)])
    # Each intermediate request ends where an assistant turn starts; the last one asks the question.
    cuts = [i for i, m in enumerate(example.messages) if m["role"] == "assistant"]
    return Rendered(example, [ids(example.messages[:i]) for i in cuts] + [ids(example.messages)])


def fit_example(task: str, seed: int, tokenizer: Any, tokens: int) -> Example:
    """The example of ``task``/``seed`` whose prompt is as close to ``tokens`` as possible (below)."""
    lo, hi = 8, max(16, tokens)
    best = make_example(task, seed, lo)
    while lo <= hi:
        mid = (lo + hi) // 2
        ex = make_example(task, seed, mid)
        n = len(render(ex, tokenizer, chain=False).turns[-1])
        if n + MAX_NEW_TOKENS <= tokens:
            best, lo = ex, mid + 1
        else:
            hi = mid - 1
    return best


def _generate(url: str, ids: list[int], max_new_tokens: int) -> dict:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    r = requests.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


_worker_tokenizer: Any = None


def _init_worker(tokenizer: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _build_one(task: str, seed: int, tokens: int, chain: bool) -> Rendered:
    return render(fit_example(task, seed, _worker_tokenizer, tokens), _worker_tokenizer, chain)


def build_items(tokenizer: Any, tasks: list[str], n: int, tokens: int, seed: int, chain: bool,
                workers: int = 1) -> list[Rendered]:
    """``n`` examples per task (seeds ``seed``, ``seed + 1``, ...), each sized to ``tokens``; ``chain``
    splits chat examples (the agent task) into one request per turn. Fitting is a binary search that
    tokenizes the whole prompt each probe (minutes for 300 examples at 16K on one core), so ``workers``
    processes share it; the items are the same for any ``workers``."""
    jobs = [(t, seed + i) for t in tasks for i in range(n)]
    if workers <= 1:
        return [render(fit_example(t, s, tokenizer, tokens), tokenizer, chain) for t, s in jobs]
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        futures = [pool.submit(_build_one, t, s, tokens, chain) for t, s in jobs]
        return [f.result() for f in futures]


def default_workers() -> int:
    """Processes for ``build_items``: the cores this process may use."""
    return len(os.sched_getaffinity(0))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_one(url: str, item: Rendered) -> tuple[bool, str, int]:
    for ids in item.turns[:-1]:  # earlier turns: the model's reply is part of the transcript
        _generate(url, ids, 1)
    out = _generate(url, item.turns[-1], MAX_NEW_TOKENS)
    text = out["text"]
    return score(item.example, text), text, len(item.turns[-1])


def evaluate(url: str, items: list[Rendered], parallel: int = 4) -> dict[str, dict[str, Any]]:
    with ThreadPoolExecutor(parallel) as pool:
        return tabulate(items, list(pool.map(lambda it: run_one(url, it), items)))


def tabulate(items: list[Rendered], results: list[tuple[bool, str, int]]) -> dict[str, dict[str, Any]]:
    """Per task: examples, correct ones, accuracy, the longest prompt, the first three failures; ``results`` as
    :func:`run_one` gives them, one per item."""
    table: dict[str, dict[str, Any]] = {}
    for item, (ok, text, n_tokens) in zip(items, results):
        row = table.setdefault(item.example.task, {"n": 0, "correct": 0, "tokens": 0, "failures": []})
        row["n"] += 1
        row["correct"] += int(ok)
        row["tokens"] = max(row["tokens"], n_tokens)
        if not ok and len(row["failures"]) < 3:
            row["failures"].append({"expected": item.example.answer, "got": text[:80]})
    for row in table.values():
        row["accuracy"] = row["correct"] / row["n"]
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sgl_sparse.quality.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model-dir", required=True, help="for the tokenizer and chat template")
    p.add_argument("--tokens", type=int, default=2048, help="prompt size per example")
    p.add_argument("--n", type=int, default=20, help="examples per task")
    p.add_argument("--seed", type=int, default=10_000, help="first example seed (training uses seeds below)")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--chain", action="store_true", help="send the agent task turn by turn")
    p.add_argument("--baseline-url", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--workers", type=positive_int, default=default_workers(),
                   help="processes that size the prompts (default: this machine's cores)")
    args = p.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        p.error(f"unknown task(s) {bad}; tasks: {', '.join(TASKS)}")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    items = build_items(tok, tasks, args.n, args.tokens, args.seed, args.chain, args.workers)
    runs = {"server": evaluate(args.url, items)}
    if args.baseline_url:
        runs["baseline"] = evaluate(args.baseline_url, items)
    print(f"| task | accuracy | max prompt tokens |{' baseline |' if args.baseline_url else ''}")
    print(f"| --- | --- | --- |{' --- |' if args.baseline_url else ''}")
    for t in tasks:
        row = runs["server"][t]
        base = f" {runs['baseline'][t]['accuracy']:.3f} |" if args.baseline_url else ""
        print(f"| {t} | {row['accuracy']:.3f} | {row['tokens']} |{base}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)
    print(json.dumps({k: {t: v[t]["accuracy"] for t in tasks} for k, v in runs.items()}), file=sys.stderr)


if __name__ == "__main__":
    main()
