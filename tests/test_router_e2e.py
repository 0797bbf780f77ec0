"""Two of our CPU servers (SnapKV, a small budget) behind sglang-router's cache-aware policy.

The router keeps an approximate text tree per worker and sends a request to the worker whose tree
matches most of its text (when the match beats ``--cache-threshold`` and load is balanced). A
conversation's later turns extend its earlier prompts, so they return to the worker holding its
Chain Cache and resume from its compacted KV there. ``sglang-router`` is a declared test
dependency (the ``test`` extra): without it this module fails, it does not skip.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import sglang_router  # noqa: F401  (a missing router is a failure, not a skip)

from sgl_sparse.server_process import CPU_SERVER_FLAGS, RouterProcess, ServerProcess
from tests.server_pool import ServerPool, spec
from tests.test_eviction_e2e import _assert_idle_and_sound, _ids, _state, written

pytestmark = pytest.mark.server

SNAPKV = {"budget": 64, "window_size": 8, "sink_tokens": 4, "kernel_size": 5, "decode_interval": 16}
WORKER_FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report", "--enable-metrics",
                "--sparse-method", "snapkv", "--sparse-config", json.dumps(SNAPKV)]
# The router's periodic health check runs a 1-token generation on each worker (SGLang's /health);
# keep it out of the test's idle checks.
ROUTER_FLAGS = ["--health-check-interval-secs", "600", "--log-level", "warn"]


@pytest.fixture(scope="module")
def routed(tiny_model: str, server_pool: ServerPool,
           prefixed_template: str) -> Iterator[tuple[RouterProcess, list]]:
    specs = [spec(tiny_model, [*WORKER_FLAGS, "--chat-template", prefixed_template], replica=i) for i in range(2)]
    with server_pool.use(*specs, once=True) as workers:
        router = RouterProcess([w.base_url for w in workers], policy="cache_aware", args=ROUTER_FLAGS)
        with router:
            yield router, list(workers)


def _requests_served(worker: ServerProcess) -> float:
    """SGLang's ``sglang:num_requests_total`` (finished requests; the health check's are not counted)."""
    text = requests.get(f"{worker.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))


def test_router_keeps_each_conversation_on_one_worker_with_chain_cache_hits(routed: tuple) -> None:
    """Four 3-turn conversations through the router's ``/generate``, each round's four turns sent at
    once. The first round spreads over both workers; every later turn returns to the worker that
    holds its conversation and reuses the whole previous sequence (prompt and answer), although
    SnapKV evicted most of it. Only that worker can report it cached: the conversations share no
    prefix."""
    router, workers = routed
    for w in workers:
        requests.post(f"{w.base_url}/flush_cache", timeout=30)
    base = [_assert_idle_and_sound(w) for w in workers]
    served_before = [_requests_served(w) for w in workers]
    rng = random.Random(17)
    n_conv, n_new, n_out = 4, 30, 12
    histories = [_ids(rng, 200) for _ in range(n_conv)]
    news = [[_ids(rng, n_new) for _ in range(n_conv)] for _ in range(3)]
    prev_len: list[int | None] = [None] * n_conv

    def turn(c: int) -> dict:
        return router.generate(input_ids=histories[c], max_new_tokens=n_out, ignore_eos=True)

    for t in range(3):
        with ThreadPoolExecutor(n_conv) as pool:
            outs = list(pool.map(turn, range(n_conv)))
        for c, out in enumerate(outs):
            meta = out["meta_info"]
            assert meta["prompt_tokens"] == len(histories[c])
            if prev_len[c] is not None:
                # The worker's Chain Cache: the whole previous logical sequence matches.
                assert meta["cached_tokens"] == prev_len[c], (t, c, meta["cached_tokens"], prev_len[c])
            prev_len[c] = written(len(histories[c]), out["output_ids"])
            histories[c] = histories[c] + out["output_ids"] + news[t][c]
    served = [_requests_served(w) - served_before[i] for i, w in enumerate(workers)]
    assert sum(served) == 3 * n_conv and min(served) > 0, served  # both workers hold conversations
    hits = []
    for i, w in enumerate(workers):
        st = _assert_idle_and_sound(w)
        assert st["evicted_tokens_total"] > base[i]["evicted_tokens_total"]
        hits.append(st["chain_hits_total"] - base[i]["chain_hits_total"])
    # turns 2 and 3 of each conversation resumed from compacted KV, on the worker that served all three
    assert hits == [2 * served[i] / 3 for i in range(2)], (hits, served)


def test_router_chat_conversations_in_parallel_keep_their_cache(routed: tuple) -> None:
    """OpenAI chat through the router, two conversations at a time: later turns report cached tokens
    covering most of the previous turn's prompt (the router matches the messages' text, the worker
    the token ids; the template renders a history turn differently from the generation prompt, so the
    cached part stops a few tokens short of it)."""
    router, workers = routed
    rng = random.Random(23)
    words = "the file list returns a value when the path exists and raises otherwise".split()

    def say(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    convs = [[{"role": "system", "content": f"session {k}: " + say(120)}, {"role": "user", "content": say(10)}]
             for k in range(2)]
    base = [_state(w)["chain_hits_total"] for w in workers]

    def turn(messages: list[dict]) -> dict:
        r = requests.post(f"{router.base_url}/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    prev_prompt = [0, 0]
    for t in range(3):
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(turn, convs))
        for k, out in enumerate(outs):
            usage = out["usage"]
            assert usage["prompt_tokens"] > SNAPKV["budget"]
            if t:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert cached >= prev_prompt[k] - 8, (t, k, usage, prev_prompt[k])
            prev_prompt[k] = usage["prompt_tokens"]
            convs[k] += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                         {"role": "user", "content": say(10)}]
    for w in workers:
        _assert_idle_and_sound(w)
    assert sum(_state(w)["chain_hits_total"] for w in workers) - sum(base) == 4
