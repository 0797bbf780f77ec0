"""An agent loop against an sgl_sparse server, through the OpenAI API: the model answers, a tool runs and its long
result goes back as a ``tool`` message, and after each turn the loop prunes the tool results older than ``--lag``
turns (``POST /v1/prefix_cache/prune`` with the turn's messages, ``roles: ["tool"]``). The pruned KV is freed while
the next turn's request, which resends the whole history, is still a prefix-cache hit; under an eviction method
each turn also resumes from the compacted KV the last one kept (Chain Cache).

Each turn prints the request's logical prompt tokens, how many of them were cached, and the conversation's KV the
server still holds (``POST /v1/prefix_cache/match``: the matched history, its resident and its hidden tokens). The
last turn asks for a fact of the older of the two newest tool results (never pruned at ``--lag`` >= 2) and prints
the answer beside it.

    python -m sgl_sparse.launch_server --model-path sgl_sparse/assets/quality-small --device cpu \\
        --attention-backend torch_native --disable-cuda-graph --enable-cache-report \\
        --sparse-method snapkv --sparse-config '{"budget": 512}'
    python examples/agent_loop.py --base-url http://127.0.0.1:30000 --turns 4 --lag 2

The tool texts come from the sentences the shipped quality models were trained on, so ``quality-small`` can answer.
``cached`` needs the server's ``--enable-cache-report`` (0 without it).
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import requests
from openai import OpenAI

from sgl_sparse.quality.tasks import KEY_WORDS, haystack_sentences


def tool_result(rng: random.Random, key: str, value: str, words: int) -> str:
    """What the tool "returns": ``words`` words of prose with one fact at a random depth."""
    sentences = haystack_sentences()
    start = rng.randrange(len(sentences))
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        out.append(sentences[(start + len(out)) % len(sentences)])
    out.insert(rng.randrange(len(out) + 1), f"The port of service {key} is {value}.")
    return " ".join(out)


def prefix_cache(base_url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(f"{base_url}/v1/prefix_cache/{route}", json=body, timeout=120)
    r.raise_for_status()
    return dict(r.json())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--turns", type=int, default=4, help="tool-calling turns before the question")
    p.add_argument("--lag", type=int, default=2, help="tool results kept unpruned (the most recent ones)")
    p.add_argument("--tool-words", type=int, default=150, help="words of each tool result")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.turns < 2 or args.lag < 2:
        p.error("--turns and --lag must be >= 2 (the question asks for the older of the two newest tool results)")
    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    rng = random.Random(args.seed)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Inspect the service configuration."}]
    facts: list[tuple[str, str]] = []

    def ask() -> tuple[str, int, int]:
        resp = client.chat.completions.create(model=args.model, messages=messages,  # type: ignore[arg-type]
                                              max_tokens=args.max_tokens, temperature=0)
        usage = resp.usage
        details = usage.prompt_tokens_details if usage else None  # absent: nothing cached, or no cache report
        cached = (details.cached_tokens or 0) if details else 0
        return resp.choices[0].message.content or "", usage.prompt_tokens if usage else 0, cached

    for turn in range(1, args.turns + 1):
        reply, prompt_tokens, cached = ask()
        pruned = 0
        if sum(m["role"] == "tool" for m in messages) > args.lag:
            # The prompt just served is cached: hide its tool results but the `lag` newest. evict_branches: the
            # reply as generated is a cached branch below them that the next turn's rendering does not reuse.
            res = prefix_cache(args.base_url, "prune", {"messages": messages, "roles": ["tool"], "lag": args.lag,
                                                        "evict_branches": True})
            pruned = int(res.get("pruned_tokens") or 0) if res.get("status") == "completed" else 0
        kv = prefix_cache(args.base_url, "match", {"messages": messages})
        print(f"turn {turn}: prompt {prompt_tokens} tokens, cached {cached}; "
              f"history {kv['matched_tokens']} tokens held as {kv['resident_tokens']} resident + "
              f"{kv['hidden_tokens']} hidden; pruned {pruned} this turn", flush=True)
        key, value = KEY_WORDS[(args.seed + turn) % len(KEY_WORDS)], str(rng.randrange(10_000, 1_000_000))
        facts.append((key, value))
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "tool", "content": tool_result(rng, key, value, args.tool_words)})

    key, value = facts[-2]  # an unpruned tool result (the quality models never saw the newest one asked)
    messages.append({"role": "user", "content": f"What is the port of service {key}?"})
    answer, prompt_tokens, cached = ask()
    print(f"question: the port of service {key}; answer {answer.strip()!r}, expected {value!r}; prompt "
          f"{prompt_tokens} tokens, cached {cached}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
