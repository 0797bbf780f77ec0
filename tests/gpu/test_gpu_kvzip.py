"""Replay forwards on the GPU (FlashInfer base): KVzip's context reconstruction and a
prune's ``kvzip_global`` run extra extend forwards of one request inside its step (integration/replay.py), which
the CPU server tests against an HF reference (tests/test_kvzip_e2e.py, tests/test_request_prune_e2e.py). Here: a
covering budget replays nothing and serves vanilla FlashInfer's tokens; a small budget replays, evicts, and CUDA
graphs give the eager server's tokens; a ``kvzip_global`` prune through the route keeps its share and frees the
rest, the next turn is a hit; nothing leaks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
from gpu_common import SELECTION_LENS, assert_idle_and_sound, assert_same_tokens, generate, ours, prose, state, vanilla

from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu

SMALL = {"budget": 1024, "chunk_size": 2048}  # 2-6K prompts: one to three replays each, most positions evicted


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {
        "vanilla": vanilla("kvzip-vanilla-flashinfer"),
        "covering": ours("kvzip-covering", "kvzip", {"budget": 16384}),
        "small": ours("kvzip-small", "kvzip", SMALL, env={"SGLSPARSE_SYNC_DEBUG": "error"}),
        "small-eager": ours("kvzip-small-eager", "kvzip", SMALL, extra=["--disable-cuda-graph"]),
        # The route's kvzip_global runs an internal request under the sequence's method, which must not evict on
        # its own (an evicting server answers 400): a dense server that serves eviction methods per request, as
        # the CPU test's (tests/test_request_prune_e2e.py).
        "dense": ours("kvzip-global-dense", "dense", extra=["--sparse-request-methods", "eviction"]),
    }
    with running(*procs.values()):
        yield procs


def _replays(server: ServerProcess) -> int:
    return int(state(server).get("method_stats", {}).get("replay_forwards", 0))


def test_a_covering_budget_replays_nothing_and_serves_vanillas_tokens(servers: dict[str, ServerProcess]) -> None:
    prompts = [prose(1300 + i, n) for i, n in enumerate(SELECTION_LENS)]
    before = _replays(servers["covering"])
    assert_same_tokens(generate(servers["vanilla"], prompts, 64), generate(servers["covering"], prompts, 64),
                       "vanilla", "kvzip covering", "batch of 5")
    assert _replays(servers["covering"]) == before
    assert_idle_and_sound(servers["covering"])


def test_a_small_budget_replays_evicts_and_graphs_equal_eager(servers: dict[str, ServerProcess]) -> None:
    prompts = [prose(1400 + i, n) for i, n in enumerate(SELECTION_LENS)]
    runs = {}
    for name in ("small", "small-eager"):
        srv = servers[name]
        replays, evicted = _replays(srv), state(srv)["evicted_tokens_total"]
        runs[name] = generate(srv, prompts, 96)
        assert _replays(srv) - replays >= len(prompts), name  # at least one replay forward a prompt
        assert state(srv)["evicted_tokens_total"] - evicted >= sum(SELECTION_LENS) - len(prompts) * SMALL["budget"]
        assert_idle_and_sound(srv)
    assert_same_tokens(runs["small-eager"], runs["small"], "kvzip eager", "kvzip graph", "batch of 5")


def test_a_kvzip_global_prune_through_the_route(servers: dict[str, ServerProcess]) -> None:
    """The prune's internal request replays its ranges' reconstruction on the GPU: of 4,000 positions in two
    ranges 256 stay, the rest of their slots go back, and the next turn is a hit through the whole prompt."""
    server = servers["dense"]
    ids = prose(1500, 6000)
    requests.post(f"{server.base_url}/flush_cache", timeout=30)
    base = assert_idle_and_sound(server)["kv_slots_used"]
    server.generate(input_ids=ids, max_new_tokens=1, ignore_eos=True)
    used = assert_idle_and_sound(server)["kv_slots_used"] - base
    ranges, keep = [[500, 2500], [3000, 5000]], 256
    r = requests.post(f"{server.base_url}/v1/prefix_cache/prune", timeout=600, json={
        "token_ids": ids, "ranges": ranges, "keep_tokens": keep, "policy": "kvzip_global"})
    assert r.status_code == 202, r.text[:300]
    res = r.json()
    assert res["status"] == "completed" and res["policy"] == "kvzip_global", res
    assert (res["pruned_tokens"], res["kept_tokens"], res["freed_slots"]) == (4000, keep, 4000 - keep), res
    assert assert_idle_and_sound(server)["kv_slots_used"] - base == used - (4000 - keep)
    nxt = server.generate(input_ids=ids + prose(1501, 64), max_new_tokens=8, ignore_eos=True)
    assert nxt["meta_info"]["cached_tokens"] == len(ids), nxt["meta_info"]
    assert_idle_and_sound(server)
