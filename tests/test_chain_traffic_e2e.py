"""A conversation's next turn under a method that evicts during decode must not depend on other traffic (CPU
servers, tiny model; found by a review).

* Copy-on-write: when every position a conversation hid lies in a prefix another conversation shares, nothing is
  freed, so its path has no hole. A next turn that leaves the previous answer before the record's ``since`` (no
  Chain Cache continuation) got a "dense" match running on into the positions the conversation computed under its
  sparse view; alone, the hole stopped the match first. The tree now marks a finished sequence's K/V computed under
  a sparse view (``RequestState.sparse_from``) and a dense match stops there.
* Overlap scheduling (SGLang's default, on CPU too) runs one more decode step for a request whose last token the
  previous step produced. The runtime treats it as a step like any other, so an eviction due at that decoded count
  runs after the answer is complete and changes the turn's record; SGLang skips that step when a new request's
  prefill takes the next iteration, so the next turn depends on unrelated traffic. Known, not fixed
  (docs/architecture.md): ``--disable-overlap-schedule`` avoids it, which the last test checks; the one before is
  a strict xfail that flips when a fix lands.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess, running

pytestmark = pytest.mark.server
FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 2000) for _ in range(n)]


def _state(server: ServerProcess) -> dict:
    return server.server_info()["internal_states"][0]["sgl_sparse"]


def _idle(server: ServerProcess) -> dict:
    deadline = time.monotonic() + 60
    while (st := _state(server))["requests_tracked"] or st["tree_protected_slots"]:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    time.sleep(0.5)
    assert requests.get(f"{server.base_url}/health", timeout=60).status_code == 200, server.log_tail()
    st = _state(server)
    assert st["kv_slots_used"] == st["tree_evictable_slots"] + st["tree_protected_slots"], st
    return st


def _flush(server: ServerProcess) -> None:
    assert requests.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
    _idle(server)


def _gen(server: ServerProcess, ids: list[int], n: int) -> dict:
    return server.generate(input_ids=ids, max_new_tokens=n, ignore_eos=True)


def test_a_shared_prefix_does_not_let_a_next_turn_read_kv_computed_under_a_sparse_view(tiny_model: str) -> None:
    """StreamingLLM (sink 16, recent 128): A's first turn (a 140-token system prompt + 10) evicts only positions of
    the system prompt, which B shares after B ran first. A's next turn leaves the answer 10 tokens before its end
    (before the last eviction: not a continuation). With or without B it must read only K/V computed with a dense
    view (the prompt, up to A's first eviction) and answer the same."""
    rng = random.Random(11)
    system, a, b, q = _ids(rng, 140), _ids(rng, 10), _ids(rng, 4), _ids(rng, 5)
    server = ServerProcess(tiny_model, [*FLAGS, "--sparse-method", "streamingllm", "--sparse-config",
                                        json.dumps({"sink_tokens": 16, "recent_tokens": 128, "evict_interval": 16})])
    with running(server):
        def conversation_a() -> dict:
            first = _gen(server, system + a, 40)["output_ids"]
            _idle(server)
            second = _gen(server, system + a + first[:30] + q, 16)
            _idle(server)
            return {"first": first, "cached": second["meta_info"]["cached_tokens"], "second": second["output_ids"]}

        _flush(server)
        alone = conversation_a()
        _flush(server)
        _gen(server, system + b, 2)  # B: 144 tokens, within the budget: evicts nothing, keeps the prompt whole
        _idle(server)
        after_b = conversation_a()
    assert alone["first"] == after_b["first"]
    # A's prompt (150 tokens) evicted at its end: positions past it were computed under the sparse view.
    assert alone["cached"] <= 150 and after_b["cached"] <= 150, (alone["cached"], after_b["cached"])
    assert after_b["second"] == alone["second"]


def _next_turn_beside_traffic(tiny_model: str, extra: list[str]) -> tuple[dict, dict]:
    """H2O evicting every 8 decoded tokens; turn 1 asks for exactly 8, so an overlap step after its last token
    lands on an eviction. Turn 1 alone, then with 3 threads of unrelated 4-token requests around it; each followed
    by the exact next turn and one leaving 3 tokens of the answer."""
    rng = random.Random(77)
    prompt, question = _ids(rng, 135), _ids(rng, 16)
    server = ServerProcess(tiny_model, [*FLAGS, *extra, "--sparse-method", "h2o", "--sparse-config", json.dumps(
        {"budget": 128, "recent_ratio": 0.25, "window_size": 8, "evict_interval": 8})])
    with running(server):
        def conversation(traffic: int) -> dict:
            _flush(server)
            before = _state(server)["eviction_steps_total"]
            stop = threading.Event()

            def background(seed: int) -> None:
                r = random.Random(seed)
                while not stop.is_set():
                    _gen(server, _ids(r, 4), 1)

            threads = [threading.Thread(target=background, args=(k,)) for k in range(traffic)]
            for t in threads:
                t.start()
            first = _gen(server, prompt, 8)["output_ids"]
            stop.set()
            for t in threads:
                t.join()
            steps = _idle(server)["eviction_steps_total"] - before
            exact = _gen(server, prompt + first + question, 10)["output_ids"]
            _idle(server)
            inside = _gen(server, prompt + first[:5] + question, 10)
            _idle(server)
            return {"first": first, "turn1_eviction_steps": steps, "exact_turn2": exact,
                    "inside_cached": inside["meta_info"]["cached_tokens"], "inside_turn2": inside["output_ids"]}

        return conversation(0), conversation(3)


@pytest.mark.xfail(strict=True, reason="overlap scheduling's step after a request's last token may evict (known, "
                                       "docs/architecture.md)")
def test_a_next_turn_does_not_depend_on_traffic_at_the_end_of_the_previous_one(tiny_model: str) -> None:
    alone, beside = _next_turn_beside_traffic(tiny_model, [])
    assert alone["first"] == beside["first"]
    assert beside == alone, {k: (alone[k], beside[k]) for k in alone if alone[k] != beside[k]}


def test_without_overlap_scheduling_a_next_turn_does_not_depend_on_traffic(tiny_model: str) -> None:
    alone, beside = _next_turn_beside_traffic(tiny_model, ["--disable-overlap-schedule"])
    assert alone["first"] == beside["first"]
    assert beside == alone, {k: (alone[k], beside[k]) for k in alone if alone[k] != beside[k]}
