"""Eviction under tensor and data parallelism through real SGLang servers on CPU: a SnapKV server (H2O, R-KV and
StreamingLLM chosen per request beside it) at --tp-size 2 (each rank holds one of the tiny model's two KV heads, so
each scores different values) against the same server at --tp-size 1, and at --dp-size 2 (a tree per rank).

If the ranks kept different sets, their allocators would diverge and the model's next all-reduce would hang (or
the leak check fire); the scores' sum over the TP group keeps them identical, and equal to one rank holding
every head, so the greedy tokens match.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, fresh, spec
from tests.test_eviction_e2e import _assert_idle_and_sound, _ids, _state

pytestmark = pytest.mark.server

# decode_interval: re-selection in decode too, so the ranks' sets must agree at every interval, not only once.
SNAPKV = {"budget": 128, "window_size": 16, "sink_tokens": 8, "kernel_size": 5, "decode_interval": 16}
FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report", "--sparse-method", "snapkv",
         "--sparse-config", json.dumps(SNAPKV)]
_CORES = sorted(os.sched_getaffinity(0))
# What SGLang 0.5.17 needs to run --tp-size 2 on this CPU machine (docs/parallelism.md):
# * SGLANG_CPU_OMP_THREADS_BIND: without it each TP rank takes a NUMA node and the scheduler asserts "tp_size 2
#   should be smaller than or equal to number of numa node on the machine 1" (utils/numa_utils.py); one core each.
# * SGLANG_NCCL_SO_PATH: no GPU here, but a CUDA build of torch ships libnccl, so SGLang's TP group binds NCCL to a
#   CUDA device and dies ("Expected a cuda device, but got: cpu", pynccl.py). A library that cannot load is
#   SGLang's own "non-GPU environment" case: NCCL off, the group's all-reduce goes through gloo.
CPU_TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": f"{_CORES[0]}|{_CORES[-1]}",
              "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}


@pytest.fixture(scope="module")
def tp1(tiny_model: str, server_pool: ServerPool) -> Iterator[ServerProcess]:
    with server_pool.use(spec(tiny_model, FLAGS), once=True) as (proc,):
        yield proc


@pytest.fixture(scope="module")
def tp2_server(tiny_model: str, server_pool: ServerPool) -> Iterator[ServerProcess]:
    # SGLSPARSE_TP_CHECK: every eviction step also checks that both ranks planned the same sets (a scheduler
    # raises, and the server dies, if not).
    with server_pool.use(spec(tiny_model, [*FLAGS, "--tp-size", "2"], env={**CPU_TP_ENV, "SGLSPARSE_TP_CHECK": "1"},
                              startup_timeout=600), once=True) as (proc,):
        yield proc


@pytest.fixture
def tp2(tp1: ServerProcess, tp2_server: ServerProcess) -> ServerProcess:
    """The --tp-size 2 server, with both it and ``tp1`` emptied first: each test compares the two from the same
    (empty) tree."""
    fresh(tp1)
    fresh(tp2_server)
    return tp2_server


@pytest.fixture  # one test's: held only while it runs, so the pool may stop it for the next test's servers
def dp2(tiny_model: str, server_pool: ServerPool) -> Iterator[ServerProcess]:
    with server_pool.use(spec(tiny_model, [*FLAGS, "--dp-size", "2"], startup_timeout=600), once=True) as (proc,):
        yield proc


# The other eviction methods, chosen per request on the same servers (custom_params; PyramidKV's per-layer
# selector is server-wide, so it is covered by the CPU gloo test only): H2O accumulates decode scores, R-KV
# re-selects every 16 decoded tokens, StreamingLLM needs no scores (lengths only).
PER_REQUEST: dict[str, dict[str, Any]] = {
    "h2o": {"budget": 128, "window_size": 16, "evict_interval": 16},
    "rkv": {"budget": 128, "window_size": 8, "evict_interval": 16},
    "streamingllm": {"sink_tokens": 8, "recent_tokens": 120, "evict_interval": 16},
}


def _generate(server: ServerProcess, ids: list[int], method: str | None = None, **extra: Any) -> dict:
    sampling: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    if method is not None:
        sampling["custom_params"] = {"sgl_sparse_method": method, "sgl_sparse_config": json.dumps(PER_REQUEST[method])}
    body = {"input_ids": ids, "sampling_params": sampling, **extra}
    r = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def test_tp2_eviction_greedy_equals_tp1(tp1: ServerProcess, tp2: ServerProcess) -> None:
    rng = random.Random(7)
    prompts = [_ids(rng, n) for n in (300, 520, 90, 700)]  # 90: under the budget, nothing evicted
    jobs = [(ids, method) for method in (None, *PER_REQUEST) for ids in prompts]
    servers = {"tp1": tp1, "tp2": tp2}
    base = {name: _state(server)["evicted_tokens_total"] for name, server in servers.items()}
    outs = {}
    for name, server in servers.items():
        # Concurrent requests: one batch observes several requests (of several methods), in the same order on
        # every rank.
        with ThreadPoolExecutor(len(jobs)) as pool:
            outs[name] = [o["output_ids"] for o in pool.map(lambda job, s=server: _generate(s, *job), jobs)]
    for i, (ids, method) in enumerate(jobs):
        assert outs["tp2"][i] == outs["tp1"][i], (method or "snapkv", len(ids))
    evicted = {name: _assert_idle_and_sound(server)["evicted_tokens_total"] - base[name]
               for name, server in servers.items()}
    assert evicted["tp1"] > 0 and evicted["tp2"] == evicted["tp1"], evicted
    assert "TP ranks planned different keep sets" not in tp2.log_tail(400)


def test_tp2_scored_prune_keeps_what_tp1_keeps(tp1: ServerProcess, tp2: ServerProcess) -> None:
    """A scored keep (POST /v1/prefix_cache/prune with keep_tokens) at --tp-size 2: each rank scores the key norms of
    its own KV head, the sum over the TP group picks the positions, so both ranks keep the same ones (else their
    allocators diverge: leak check, or a hang at the next collective), and they are the ones --tp-size 1 keeps."""
    rng = random.Random(17)
    ids = _ids(rng, 300)
    results, hidden, nexts = {}, {}, {}
    for name, server in (("tp1", tp1), ("tp2", tp2)):
        seq = ids + _generate(server, ids)["output_ids"]
        body = {"token_ids": seq, "ranges": [[20, 120], [150, 250]], "keep_tokens": 30, "policy": "knorm"}
        r = requests.post(f"{server.base_url}/v1/prefix_cache/prune", json=body, timeout=120)
        assert r.status_code == 202, r.text
        results[name] = {k: v for k, v in r.json().items() if k != "prune_id"}
        insp = requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": seq}, timeout=60).json()
        hidden[name] = insp["hidden_ranges"]
        nexts[name] = _generate(server, seq + _ids(random.Random(18), 12))
        _assert_idle_and_sound(server)
    res = results["tp1"]
    assert res["status"] == "completed" and res["kept_tokens"] == 30 and res["freed_slots"] > 0, res
    assert res["freed_slots"] == res["pruned_tokens"] - 30, res
    assert results["tp2"] == res and hidden["tp2"] == hidden["tp1"]
    assert nexts["tp2"]["output_ids"] == nexts["tp1"]["output_ids"]
    assert nexts["tp2"]["meta_info"]["cached_tokens"] == nexts["tp1"]["meta_info"]["cached_tokens"] > 300


def test_tp2_request_scored_keep_keeps_what_tp1_keeps(tp1: ServerProcess, tp2: ServerProcess) -> None:
    """A request's own prune with a scored keep (custom_params sgl_sparse_prune, policy snapkv_global) at --tp-size 2:
    each rank scores its own KV head with the prompt's last queries, the sum over the TP group picks the kept
    positions (then SnapKV evicts down to its budget from what is left), so both ranks hide the same ones, those
    --tp-size 1 hides, and decode the same tokens."""
    ids = _ids(random.Random(27), 320)
    prune = json.dumps({"ranges": [[30, 130], [160, 260]], "keep_tokens": 40, "policy": "snapkv_global"})
    outs, hidden = {}, {}
    for name, server in (("tp1", tp1), ("tp2", tp2)):
        body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True,
                                                      "custom_params": {"sgl_sparse_prune": prune}}}
        r = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
        assert r.status_code == 200, r.text[:300]
        outs[name] = r.json()["output_ids"]
        insp = requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": ids + outs[name]},
                             timeout=60).json()
        hidden[name] = {q for lo, hi in insp["hidden_ranges"] for q in range(lo, hi)}
        _assert_idle_and_sound(server)
    in_ranges = {q for q in hidden["tp1"] if 30 <= q < 130 or 160 <= q < 260}
    assert len(in_ranges) >= 200 - 40 and hidden["tp1"], sorted(hidden["tp1"])[:20]
    assert hidden["tp2"] == hidden["tp1"] and outs["tp2"] == outs["tp1"]
    assert "TP ranks planned different keep sets" not in tp2.log_tail(400)


def test_dp2_one_tree_per_rank_and_affinity(tp1: ServerProcess, dp2: ServerProcess) -> None:
    """Each DP rank runs its own scheduler, tree and runtime; a conversation pinned to one rank
    (``routed_dp_rank``, what the X-Data-Parallel-Rank header sets) resumes there from its compacted KV."""
    ids = _ids(random.Random(3), 400)
    first = _generate(dp2, ids, routed_dp_rank=1)
    assert first["output_ids"] == _generate(tp1, ids)["output_ids"]  # a DP rank serves as a lone server
    turn = [*ids, *first["output_ids"], *_ids(random.Random(4), 30)]
    second = _generate(dp2, turn, routed_dp_rank=1)
    assert second["meta_info"]["cached_tokens"] >= len(ids), second["meta_info"]  # Chain Cache on rank 1
    by_rank = {s["sgl_sparse"]["dp_rank"]: s["sgl_sparse"] for s in dp2.server_info()["internal_states"]}
    assert sorted(by_rank) == [0, 1], by_rank.keys()  # the ranks' states come in arrival order: keyed by rank
    states = [by_rank[0], by_rank[1]]
    assert states[1]["evicted_tokens_total"] > 0 and states[1]["chain_hits_total"] >= 1, states[1]
    assert states[0]["evicted_tokens_total"] == 0 and states[0]["chain_hits_total"] == 0, states[0]


# KVzip: scores are maxima over heads (replay forwards), so the ranks take their maximum, not their sum.
KVZIP = {"budget": 64, "chunk_size": 128}
KVZIP_FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report", "--sparse-method",
               "kvzip", "--sparse-config", json.dumps(KVZIP)]


def test_tp2_kvzip_replays_keep_what_tp1_keeps(tiny_model: str, server_pool: ServerPool) -> None:
    """KVzip at --tp-size 2: every rank runs the same replay forwards (their all-reduces matched), scores its own KV
    head, and the maximum over the ranks is the maximum over every head, so both ranks keep the positions one rank
    holding both heads keeps and decode the same tokens; a request's own kvzip_global prune too (its replays score
    the ranges, then KVzip evicts from the rest). The ranks' keep sets are checked equal at every step."""
    specs = (spec(tiny_model, KVZIP_FLAGS, startup_timeout=600),
             spec(tiny_model, [*KVZIP_FLAGS, "--tp-size", "2"], env={**CPU_TP_ENV, "SGLSPARSE_TP_CHECK": "1"},
                  startup_timeout=600))
    rng = random.Random(37)
    prompts = [_ids(rng, n) for n in (300, 450, 40)]  # 40: under the budget, no replay
    prune = json.dumps({"ranges": [[20, 120], [150, 250]], "keep_tokens": 30, "policy": "kvzip_global"})
    outs, hidden, stats = {}, {}, {}
    with server_pool.use(*specs) as (tp1, tp2):
        for server in (tp1, tp2):  # tp1 is test_kvzip_e2e.py's server: both compared from an empty tree
            fresh(server)
        for name, server in (("tp1", tp1), ("tp2", tp2)):
            base = _state(server)
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs[name] = [o["output_ids"] for o in pool.map(lambda ids, s=server: _generate(s, ids), prompts)]
            body = {"input_ids": prompts[1], "sampling_params": {
                "temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True,
                "custom_params": {"sgl_sparse_prune": prune}}}
            r = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
            assert r.status_code == 200, r.text[:300]
            outs[name].append(r.json()["output_ids"])
            assert r.json()["meta_info"]["sgl_sparse"]["prune"]["status"] == "applied", r.json()["meta_info"]
            seq = prompts[1] + outs[name][-1]
            insp = requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": seq},
                                 timeout=60).json()
            hidden[name] = insp["hidden_ranges"]
            st = _assert_idle_and_sound(server)
            stats[name] = {k: st["method_stats"][k] - base.get("method_stats", {}).get(k, 0)
                           for k in ("scored_requests", "replay_forwards")}
            stats[name]["evicted"] = st["evicted_tokens_total"] - base["evicted_tokens_total"]
        assert "TP ranks planned different keep sets" not in tp2.log_tail(400)
    assert outs["tp2"] == outs["tp1"] and hidden["tp2"] == hidden["tp1"] and hidden["tp1"]
    assert stats["tp2"] == stats["tp1"], stats
    assert stats["tp1"]["scored_requests"] == 3 and stats["tp1"]["replay_forwards"] >= 5, stats
