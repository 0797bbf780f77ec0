"""SGLang flags that change how steps are formed, served with eviction on CPU (our launcher, tiny model).

* ``--enable-mixed-chunk``: a step mixes prefill chunks with decode tokens of running requests. The
  runtime decides prefill vs decode per request (the batch's mode is "mixed", an extend), so a decoding
  request is never taken for a final prefill: SnapKV scores each prompt once, StreamingLLM keeps its
  decode slack.
* ``--disable-radix-cache``: SGLang still builds our tree (a registered backend wins), disabled; a
  prompt longer than ``--chunked-prefill-size`` must continue chunk after chunk (the stock radix tree
  returns early there and the prompt would restart at its first chunk forever).
* ``--enable-priority-scheduling``: a higher-priority request preempts a running one, which SGLang releases
  (``release_req``: its KV freed without insert, as a retraction under memory pressure does) and re-queues; it
  then recomputes its prompt and output so far, and SnapKV scores it again.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, spec, wait_idle_checked
from tests.server_pool import state as _state

pytestmark = pytest.mark.server

FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128"]
SNAPKV = {"budget": 200, "window_size": 16, "sink_tokens": 8}
STREAMING = {"sink_tokens": 16, "recent_tokens": 128, "evict_interval": 32}


@pytest.fixture(scope="module")
def flag_servers(tiny_model: str, server_pool: ServerPool) -> Iterator[dict[str, ServerProcess]]:
    specs = {
        "mixed": spec(tiny_model, [*FLAGS, "--enable-mixed-chunk", "--sparse-method", "snapkv",
                                   "--sparse-config", json.dumps(SNAPKV)]),
        "no_radix": spec(tiny_model, [*FLAGS, "--disable-radix-cache", "--sparse-method", "streamingllm",
                                      "--sparse-config", json.dumps(STREAMING)]),
        "priority": spec(tiny_model, [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "256",
                                      "--enable-priority-scheduling", "--max-running-requests", "1",
                                      "--max-total-tokens", "4000", "--sparse-method", "snapkv",
                                      "--sparse-config", json.dumps(SNAPKV)]),
    }
    with server_pool.use(*specs.values(), once=True) as started:
        yield dict(zip(specs, started))


def _idle(server: ServerProcess, timeout: float = 60.0) -> dict:
    wait_idle_checked(server, timeout, protected=False)
    st = _state(server)
    assert st["kv_slots_used"] == st["tree_evictable_slots"] + st["tree_protected_slots"], st
    return st


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 2048) for _ in range(n)]


def test_mixed_chunk_scores_each_prompt_once(flag_servers: dict) -> None:
    server = flag_servers["mixed"]
    rng = random.Random(2)
    before = _idle(server)
    # A long decode, and while it runs, prompts whose chunks are mixed with its decode steps.
    long_run = threading.Thread(target=server.generate, kwargs={
        "input_ids": _ids(rng, 400), "max_new_tokens": 300, "ignore_eos": True})
    long_run.start()
    time.sleep(1.0)
    for _ in range(3):
        out = server.generate(input_ids=_ids(rng, 500), max_new_tokens=10, ignore_eos=True)
        assert out["meta_info"]["completion_tokens"] == 10
    long_run.join()
    after = _idle(server)
    # One selection per prompt over the budget (decode_interval is 0): 4 prompts, 4 eviction steps.
    assert after["eviction_steps_total"] - before["eviction_steps_total"] == 4


def test_disabled_radix_cache_serves_chunked_prompts_without_leaks(flag_servers: dict) -> None:
    server = flag_servers["no_radix"]
    rng = random.Random(3)
    prompt = _ids(rng, 1000)  # ~8 chunks of 128
    first = server.generate(input_ids=prompt, max_new_tokens=40, ignore_eos=True, timeout=300)
    again = server.generate(input_ids=prompt, max_new_tokens=40, ignore_eos=True, timeout=300)
    assert first["output_ids"] == again["output_ids"]
    assert again["meta_info"]["cached_tokens"] == 0  # nothing is cached with the tree disabled
    st = _idle(server)
    assert st["kv_slots_used"] == 0 and st["evicted_tokens_total"] > 0


def test_a_preempted_evicting_request_is_released_recomputed_and_leaks_nothing(flag_servers: dict) -> None:
    server = flag_servers["priority"]
    rng = random.Random(4)
    before = _idle(server)
    done: dict[str, float] = {}
    outs: dict[str, dict] = {}

    def send(name: str, n: int, out: int, priority: int) -> None:
        r = requests.post(f"{server.base_url}/generate", timeout=600, json={
            "input_ids": _ids(rng, n), "priority": priority,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": out, "ignore_eos": True}})
        r.raise_for_status()
        outs[name], done[name] = r.json(), time.monotonic()

    low = threading.Thread(target=send, args=("low", 500, 900, 0))
    low.start()
    deadline = time.monotonic() + 120
    while _state(server)["requests_tracked"] == 0:  # low is running (one slot: --max-running-requests 1)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)
    send("high", 1000, 20, 100)  # priority 100 - 0 > the preemption threshold (10)
    low.join()
    assert outs["low"]["meta_info"]["completion_tokens"] == 900 and outs["high"]["meta_info"]["completion_tokens"] == 20
    assert done["high"] < done["low"]
    after = _idle(server)
    # Each prompt's excess over the budget is evicted once (300 + 800); the preempted request's recompute of its
    # prompt and output so far is scored and evicted again.
    assert after["eviction_steps_total"] - before["eviction_steps_total"] == 3, (before, after)
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] > 1100 + 300
