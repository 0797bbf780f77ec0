"""The main job in one command: the same multi-turn agent program under `dense` and under an eviction
method, on our server, side by side.

    python -m sgl_sparse.demo [--sparse-method snapkv] [--sparse-config JSON] [--methods dense,snapkv]
                              [--model-path DIR] [--device cpu]

Without ``--model-path`` it serves the small model we trained and ship (``sgl_sparse/assets/quality-small``,
~4M parameters, 2K context). The program is an SGLang frontend-language function: an agent session of
four steps; the model writes each step, the program appends a tool result that carries one fact (a
service port) among documentation prose, and the last user turn asks for the fact of the *first* tool
result. Each turn extends the previous one's text, so the server reuses the conversation's prefix: under
an eviction method (Chain Cache) it resumes from the KV the previous turn kept, prefilling only the new
suffix. The conversation is the suite's ``agent_recall`` example of seed 10,000 (``sgl_sparse/quality``;
the model was trained on that format, with seeds below 10,000; its prose is the suite's corpus, stdlib
docstrings, so it varies a little with the Python version).

For each method in turn it starts a server (CPU by default), flushes its cache, runs the program, reads
``/server_info`` after every turn, stops the server, and then prints per turn and per method:

* ``logical``: tokens of the conversation so far (the turn's prompt + what the model wrote);
* ``KV kept``: KV slots in use after the turn (``kv_slots_used`` on an idle server that holds only this
  conversation: its physical footprint, held by the prefix tree);
* ``cached``: ``meta_info["cached_tokens"]`` of the turn's request (logical prompt tokens reused);
* the model's output; and a verdict: are the answers right, and equal?

The default eviction method is ``snapkv`` with a 512-token budget: the last turn's prompt is 1,562
tokens, three times the budget, and the answer still comes out right.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS, GPU_SERVER_FLAGS, ServerProcess

# The conversation: one example of the task suite (evaluation seeds start at 10,000), 4 tool results of
# ~320-430 tokens; the suite asks, for this seed, for the first tool result's fact.
SEED, WORDS = 10_000, 1000
TASK = "Inspect the service configuration."
# Sparse configs used when --sparse-config is not given: small enough to evict most of the conversation.
# SnapKV 512 (sink 64, window 32) answered the first tool result's fact right in 10 of 10 such sessions
# (seeds 10,000-10,009, 1,560-1,970 tokens, on CPU); smaller budgets lose digits of it (in sessions of
# 1,300-1,660 tokens, 384 answered 6 of 10 right, 256 2 of 7).
# StreamingLLM keeps only the sink and the recent window, so the first tool result's fact is gone.
DEMO_CONFIGS: dict[str, dict[str, Any]] = {
    "snapkv": {"budget": 512},
    "streamingllm": {"sink_tokens": 64, "recent_tokens": 448},
    "h2o": {"budget": 512},  # as SnapKV's budget; not measured on the demo's sessions yet
    "rkv": {"budget": 512},  # as SnapKV's budget; not measured on the demo's sessions yet
    # The mean per layer, as SnapKV's budget (the pool holds the union of the layers' sets: more); not measured yet.
    "pyramidkv": {"budget": 512},
}
STEP_TOKENS, ANSWER_TOKENS = 8, 12


@dataclass
class Conversation:
    tool_results: list[str]
    question: str
    answer: str
    fact_turn: int  # 1-based: the turn whose tool result holds the asked fact


def conversation() -> Conversation:
    from sgl_sparse.quality.tasks import make_example

    ex = make_example("agent_recall", SEED, WORDS)
    assert ex.messages is not None
    tools = [m["content"] for m in ex.messages if m["role"] == "tool"]
    question = ex.messages[-1]["content"]
    key = re.fullmatch(r"What is the port of service (\w+)\?", question)
    assert key, question
    fact = f"The port of service {key.group(1)} is {ex.answer}."
    fact_turn = next(i + 1 for i, t in enumerate(tools) if fact in t)
    return Conversation(tools, question, ex.answer, fact_turn)


@dataclass
class Turn:
    name: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kv_slots_used: int
    output: str

    @property
    def logical(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Run:
    method: str
    config: dict[str, Any]
    turns: list[Turn] = field(default_factory=list)
    answer: str = ""
    right: bool = False
    counters: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return self.method if not self.config else f"{self.method} {json.dumps(self.config)}"


def _agent_session():  # type: ignore[no-untyped-def]
    import sglang as sgl

    @sgl.function
    def agent_session(s, task: str, tool_results: list[str], question: str, after_turn):  # type: ignore[no-untyped-def]
        # The chat template the model was trained with (tiny_model.CHAT_TEMPLATE), written out.
        s += f"<|system|>You are a coding agent.<|end|><|user|>{task}<|end|>"
        for i, result in enumerate(tool_results):
            s += "<|assistant|>"
            s += sgl.gen(f"step{i + 1}", max_tokens=STEP_TOKENS, temperature=0, stop="<|end|>")
            after_turn(s, f"step{i + 1}")  # waits for the step; the tool would run here
            s += f"<|end|><|tool|>{result}<|end|>"
        s += f"<|user|>{question}<|end|><|assistant|>"
        s += sgl.gen("answer", max_tokens=ANSWER_TOKENS, temperature=0, stop="<|end|>")
        after_turn(s, "answer")

    return agent_session


def _start_server(model: str, flags: list[str], attempts: int = 3) -> ServerProcess:
    """A started server. On a busy host a port that SGLang picked at launch (its torch-distributed port)
    can be taken by another process before the scheduler binds it, a minute later on a loaded CPU: then
    the server exits with EADDRINUSE, and a fresh start (new ports) is tried."""
    for attempt in range(1, attempts + 1):
        server = ServerProcess(model, flags)
        try:
            return server.start()
        except RuntimeError as e:
            if attempt == attempts or "EADDRINUSE" not in str(e):
                raise
            print(f"  server lost a port race (EADDRINUSE); starting it again ({attempt + 1}/{attempts})", flush=True)
    raise AssertionError("unreachable")


def run_method(method: str, config: dict[str, Any], conv: Conversation, model: str, device: str) -> Run:
    import sglang as sgl

    flags = CPU_SERVER_FLAGS if device == "cpu" else GPU_SERVER_FLAGS
    flags = [*flags, "--sparse-method", method, "--sparse-config", json.dumps(config)]
    run = Run(method, config)
    print(f"[{run.label}] starting: python -m sgl_sparse.launch_server --model-path {model} {' '.join(flags)}",
          flush=True)
    t0 = time.monotonic()
    server = _start_server(model, flags)
    try:
        # Only this conversation on the server: what the warm-up and health checks left goes.
        requests.post(f"{server.base_url}/flush_cache", timeout=30).raise_for_status()

        def sparse_state() -> dict[str, Any]:
            return server.server_info()["internal_states"][0]["sgl_sparse"]

        def after_turn(s: Any, name: str) -> None:
            meta = s.get_meta_info(name)  # blocks until the turn is generated
            if meta is None:  # the request failed: the frontend's executor thread holds the error
                raise RuntimeError(f"{run.label}: {name} failed: {s.error()!r}")
            run.turns.append(Turn(name, meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"],
                                  sparse_state()["kv_slots_used"], s[name]))

        t1 = time.monotonic()
        state = _agent_session().run(task=TASK, tool_results=conv.tool_results, question=conv.question,
                                     after_turn=after_turn, backend=sgl.RuntimeEndpoint(server.base_url))
        run.answer = state["answer"].strip()
        run.right = run.answer == conv.answer
        run.counters = sparse_state()
        print(f"[{run.label}] server up in {t1 - t0:.0f} s, program ran in {time.monotonic() - t1:.0f} s; "
              "stopping it", flush=True)
    finally:
        server.stop()
    run.seconds = time.monotonic() - t0
    return run


def print_report(runs: list[Run], conv: Conversation) -> None:
    w = max(len(r.method) for r in runs)
    print(f"\nquestion (turn {len(conv.tool_results) + 1}): {conv.question}  expected: {conv.answer} "
          f"(from turn {conv.fact_turn}'s tool result)")
    print("logical: conversation tokens after the turn; KV kept: KV slots in use after it (physical); "
          "cached: prompt tokens the server reused (logical)\n")
    print(f"{'turn':<10}{'method':<{w + 2}}{'logical':>8}{'KV kept':>9}{'cached':>8}  output")
    for i, name in enumerate(t.name for t in runs[0].turns):
        for j, r in enumerate(runs):
            t = r.turns[i]
            print(f"{f'{i + 1} {name}' if j == 0 else '':<10}{r.method:<{w + 2}}{t.logical:>8}{t.kv_slots_used:>9}"
                  f"{t.cached_tokens:>8}  {t.output!r}")
    print()
    for r in runs:
        c = r.counters
        print(f"{r.label}: evicted {c.get('evicted_tokens_total', 0)} tokens in {c.get('eviction_steps_total', 0)} "
              f"steps; Chain Cache hits {c.get('chain_hits_total', 0)}; answer {r.answer!r} "
              f"{'right' if r.right else 'WRONG'}")
    last = [r.turns[-1].kv_slots_used for r in runs]
    equal = len({r.answer for r in runs}) == 1
    right = [r.method for r in runs if r.right]
    wrong = [r.method for r in runs if not r.right]
    parts = [f"answers {'equal' if equal else 'differ'}"] if len(runs) > 1 else []
    parts += [f"right under {' and '.join(right)}"] if right else []
    parts += [f"WRONG under {' and '.join(wrong)}"] if wrong else []
    verdict = "; ".join(parts)
    kv = ", ".join(f"{r.method} {n}" for r, n in zip(runs, last))
    dense = next((n for r, n in zip(runs, last) if r.method == "dense"), None)
    if dense is not None and len(runs) > 1:
        kv += " (" + ", ".join(f"{r.method} {dense / n:.1f}x fewer" for r, n in zip(runs, last)
                               if r.method != "dense" and n) + ")"
    print(f"verdict: {verdict} (expected {conv.answer}); KV slots at the last turn: {kv}")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[tuple[str, dict[str, Any]]]]:
    from sgl_sparse.config import load_config_source
    from sgl_sparse.errors import SparseConfigError
    from sgl_sparse.registry import create_method

    p = argparse.ArgumentParser(prog="python -m sgl_sparse.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the small trained model we ship")
    p.add_argument("--sparse-method", default="snapkv", help="the method compared with dense (default snapkv)")
    p.add_argument("--sparse-config", default=None,
                   help=f"its config, JSON or a file (default for the demo: {json.dumps(DEMO_CONFIGS)}; else {{}})")
    p.add_argument("--methods", default=None,
                   help="comma-separated methods to run, in order (default: dense,SPARSE_METHOD); "
                        "--sparse-config applies to each one but dense")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args(argv)
    names = [m for m in (args.methods or f"dense,{args.sparse_method}").split(",") if m]
    names = list(dict.fromkeys(names))  # `--sparse-method dense` runs dense once
    methods = []
    try:
        for name in names:
            if name == "dense":
                config: dict[str, Any] = {}
            elif args.sparse_config is not None:
                config = load_config_source(args.sparse_config)
            else:
                config = dict(DEMO_CONFIGS.get(name, {}))
            create_method(name, config)  # unknown method or field, bad value: an error before any server
            methods.append((name, config))
    except SparseConfigError as e:
        p.error(str(e))
    if not methods:
        p.error("--methods: no method given")
    return args, methods


def main(argv: list[str] | None = None) -> list[Run]:
    from sgl_sparse.quality.models import small_model_path

    args, methods = parse_args(argv)
    model = args.model_path or str(small_model_path())
    conv = conversation()
    start = time.monotonic()
    runs = [run_method(name, config, conv, model, args.device) for name, config in methods]
    print_report(runs, conv)
    print(f"done in {time.monotonic() - start:.0f} s (both servers started and stopped one after the other)"
          if len(runs) > 1 else f"done in {time.monotonic() - start:.0f} s")
    return runs


if __name__ == "__main__":
    main()
