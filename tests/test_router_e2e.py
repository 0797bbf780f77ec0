"""Two of our CPU servers (SnapKV, a small budget) behind SGLang's gateway, smg: its cache-aware policy and its sticky
routing key.

The router keeps an approximate text tree per worker and sends a request to the worker whose tree
matches most of its text (when the match beats ``--cache-threshold`` and load is balanced). A
conversation's later turns extend its earlier prompts, so they return to the worker holding its
Chain Cache and resume from its compacted KV there. ``smg`` is a declared test
dependency (the ``test`` extra): without it this module fails, it does not skip.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import smg  # noqa: F401  (a missing gateway is a failure, not a skip)

from sgl_sparse.server_process import CPU_SERVER_FLAGS, RouterProcess, ServerProcess
from tests.server_pool import ServerPool, spec
from tests.test_eviction_e2e import _assert_idle_and_sound, _ids, _state, written

pytestmark = pytest.mark.server

SNAPKV = {"budget": 64, "window_size": 8, "sink_tokens": 4, "kernel_size": 5, "decode_interval": 16}
WORKER_FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report", "--enable-metrics",
                "--sparse-method", "snapkv", "--sparse-config", json.dumps(SNAPKV)]
# The router's periodic health check runs a 1-token generation on each worker (SGLang's /health);
# keep it out of the test's idle checks. RouterProcess waits until the router has polled every worker's load
# (a new conversation goes to the least expected wait, and an unpolled worker ties with the others at random):
# a 1 s poll makes that wait short.
ROUTER_FLAGS = ["--health-check-interval-secs", "600", "--load-monitor-interval", "1", "--log-level", "warn"]


@pytest.fixture(scope="module")
def routed(tiny_model: str, server_pool: ServerPool,
           prefixed_template: str) -> Iterator[tuple[RouterProcess, list]]:
    specs = [spec(tiny_model, [*WORKER_FLAGS, "--chat-template", prefixed_template], replica=i) for i in range(2)]
    with server_pool.use(*specs, once=True) as workers:
        router = RouterProcess([w.base_url for w in workers], policy="cache_aware", args=ROUTER_FLAGS)
        with router:
            yield router, list(workers)


def _model(router: RouterProcess) -> str:
    """The model the gateway serves (it routes OpenAI requests by ``model``: SGLang's ``default`` alias is a
    worker's, not the gateway's)."""
    models = requests.get(f"{router.base_url}/v1/models", timeout=30).json()["data"]
    assert len({m["id"] for m in models}) == 1, models
    return str(models[0]["id"])


def _requests_served(worker: ServerProcess) -> float:
    """SGLang's ``sglang:num_requests_total`` (finished requests; the health check's are not counted)."""
    text = requests.get(f"{worker.base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))


def test_router_keeps_each_conversation_on_one_worker_with_chain_cache_hits(routed: tuple) -> None:
    """Four 3-turn conversations through the router's ``/generate``, each round's four turns sent at
    once. The first round spreads over both workers (each new conversation goes to the least expected
    wait, which counts the requests sent since the last load poll); every later turn returns to the worker that
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
    model = _model(router)

    def turn(messages: list[dict]) -> dict:
        r = requests.post(f"{router.base_url}/v1/chat/completions", timeout=120, json={
            "model": model, "messages": messages, "max_tokens": 8, "temperature": 0})
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


def _holder(workers: list, seq: list[int]) -> tuple[int, dict]:
    """The one worker whose tree matches ``seq`` (the conversation's), with its inspect answer."""
    found = [(i, requests.post(f"{w.base_url}/v1/prefix_cache/inspect", json={"token_ids": seq}, timeout=30).json())
             for i, w in enumerate(workers)]
    held = [(i, r) for i, r in found if r["matched_tokens"] > 0]
    assert len(held) == 1, found
    return held[0]


def test_a_prune_sent_through_the_gateway_reaches_the_worker_that_holds_the_conversation(routed: tuple) -> None:
    """A turn that prunes its own prompt (``custom_params`` ``sgl_sparse_prune``) travels through the gateway like any
    other: the cache-aware policy sends it to the worker holding the conversation, which hides the ranges and
    keeps the Chain Cache hit."""
    router, workers = routed
    for w in workers:
        requests.post(f"{w.base_url}/flush_cache", timeout=30)
    rng = random.Random(29)
    prompt = _ids(rng, 240)
    first = router.generate(input_ids=prompt, max_new_tokens=8, ignore_eos=True)
    seq = prompt + first["output_ids"]
    holder, _ = _holder(workers, seq)
    history = seq + _ids(rng, 20)
    prune = json.dumps({"ranges": [[100, 180]]})
    second = router.generate(input_ids=history, max_new_tokens=8, ignore_eos=True,
                             custom_params={"sgl_sparse_prune": prune})
    assert second["meta_info"]["cached_tokens"] == written(len(prompt), first["output_ids"]), second["meta_info"]
    where, inspect = _holder(workers, history + second["output_ids"])
    assert where == holder
    hidden = {p for lo, hi in inspect["hidden_ranges"] for p in range(lo, hi)}
    assert set(range(100, 180)) <= hidden, inspect["hidden_ranges"]
    for w in workers:
        _assert_idle_and_sound(w)


def test_the_sticky_routing_key_keeps_a_conversation_on_one_worker_under_round_robin(routed: tuple) -> None:
    """``--routing-key-override`` with the ``x-smg-routing-key`` header: round robin alone sends a conversation's
    second turn to the other worker (no hit); with the key each conversation's turns stay together and hit."""
    _, workers = routed
    for w in workers:
        requests.post(f"{w.base_url}/flush_cache", timeout=30)
    sticky = RouterProcess([w.base_url for w in workers], policy="round_robin",
                           args=[*ROUTER_FLAGS, "--routing-key-override", "--routing-key-headers",
                                 "x-smg-routing-key"])
    rng = random.Random(31)

    def turn(history: list[int], key: str | None) -> dict:
        r = requests.post(f"{sticky.base_url}/generate", timeout=120,
                          headers={"x-smg-routing-key": key} if key else {},
                          json={"input_ids": history, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return dict(r.json())

    with sticky:
        # Without a key, round robin: the second turn lands on the other worker, which holds nothing of it.
        history = _ids(rng, 150)
        out = turn(history, None)
        assert turn(history + out["output_ids"] + _ids(rng, 10), None)["meta_info"]["cached_tokens"] == 0
        for k in range(3):
            history = _ids(rng, 150)
            prev = 0
            for t in range(3):
                out = turn(history, f"conversation-{k}")
                if t:
                    assert out["meta_info"]["cached_tokens"] == prev, (k, t, out["meta_info"])
                prev = written(len(history), out["output_ids"])
                history = history + out["output_ids"] + _ids(rng, 10)
    for w in workers:
        _assert_idle_and_sound(w)
