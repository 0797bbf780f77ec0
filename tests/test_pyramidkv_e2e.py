"""PyramidKV through real SGLang servers on CPU (our launcher, tiny model of 4 layers): a PyramidKV server, its
negative control (same selection, every layer reads the union: ``tests/pyramidkv_union.py``) and a dense one.
Dense token for token while the budget covers the context (prompts longer than the window and a chunk); past it,
the pool holds exactly the union of the layers' sets (reported in ``method_stats``) plus the decoded tokens;
the layers read their own sets, in decode and in a continuation's prefill (outputs differ from the control's
while the same slots are in use); Chain Cache turns, concurrency and aborts without a leak (SGLang's strict
idle check is on).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sgl_sparse.methods.eviction.pyramidkv import layer_budgets
from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, Spec, spec
from tests.test_eviction_e2e import (
    _assert_idle_and_sound,
    _flush,
    _ids,
    _state,
    abort_mid_prefill_and_mid_decode,
    alone_equals_beside_traffic,
    covering_budget_equals_dense,
    written,
)

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]
SMALL = {"budget": 512, "window_size": 16, "sink_tokens": 8, "kernel_size": 5, "beta": 20}
LAYERS = 4  # the tiny model's


def _server(model: str, method: str, config: dict | None = None) -> Spec:
    extra = ["--sparse-config", json.dumps(config)] if config is not None else []
    env = {"SGLSPARSE_METHOD_MODULES": "tests.pyramidkv_union",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return spec(model, [*FLAGS, "--sparse-method", method, *extra], env=env, startup_timeout=900)


@pytest.fixture(scope="module")
def pyramid_servers(server_pool: ServerPool, servers: dict[str, ServerProcess],
                    tiny_model: str) -> Iterator[dict[str, ServerProcess]]:
    with server_pool.use(_server(tiny_model, "pyramidkv", SMALL),
                         _server(tiny_model, "pyramidkv_union", SMALL), once=True) as (small, union):
        yield {"dense": servers["ours"], "small": small, "union": union}


def _generate_with_logprobs(server: ServerProcess, ids: list[int], n_out: int) -> dict:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": n_out, "ignore_eos": True}}
    r = requests.post(f"{server.base_url}/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def _logprobs(out: dict) -> list[float]:
    return [lp[0] for lp in out["meta_info"]["output_token_logprobs"]]


def test_server_info_reports_pyramidkv(pyramid_servers: dict) -> None:
    st = _state(pyramid_servers["small"])
    assert st["method"] == "pyramidkv" and st["family"] == "eviction"
    assert st["config"] == {**SMALL, "pooling": "avgpool", "decode_interval": 0}


def test_budget_covering_context_equals_dense(pyramid_servers: dict) -> None:
    """Contexts within the budget: prompts longer than the window and than a 128-token chunk, decode after: no
    layer drops anything, the tokens are dense's."""
    before, st = covering_budget_equals_dense(pyramid_servers, ((40, 24), (200, 150), (450, 60)))
    assert st.get("method_stats", {}).get("selections", 0) == before.get("method_stats", {}).get("selections", 0)


def test_pool_holds_the_union_and_layers_read_their_own_sets(pyramid_servers: dict) -> None:
    """Past the budget: the pool keeps the union of the layers' sets (more than the mean budget, at most the sum
    of the layer budgets) plus the decoded tokens. The control holds the same slots (same selection: the prompt's
    window scores are computed before any selection) but its layers read the union, so decode differs; the first
    token (from the prefill, before the selection) is the same."""
    ids, n_out = _ids(random.Random(1), 1500), 60
    outs, used, stats = {}, {}, {}
    for name in ("small", "union"):
        server = pyramid_servers[name]
        before = _flush(server)
        outs[name] = _generate_with_logprobs(server, ids, n_out)
        assert outs[name]["meta_info"]["completion_tokens"] == n_out
        after = _assert_idle_and_sound(server)
        used[name] = after["kv_slots_used"] - before["kv_slots_used"]
        b, a = before.get("method_stats", {}), after["method_stats"]
        stats[name] = {k: a[k] - b.get(k, 0) for k in ("selections", "union_tokens_total", "layer_tokens_total")}
        stats[name]["budgets"] = a["last_layer_budgets"]
    budgets = layer_budgets(1500, LAYERS, SMALL["budget"], SMALL["sink_tokens"] + SMALL["window_size"], 20,
                            SMALL["window_size"])
    assert stats["small"]["budgets"] == budgets and budgets[0] > budgets[-1]
    assert stats["small"]["selections"] == 1
    union = stats["small"]["union_tokens_total"]
    assert stats["small"]["layer_tokens_total"] == sum(budgets)
    assert max(budgets) <= union <= sum(budgets) and union > SMALL["budget"]
    # What stays resident: the union plus the decoded tokens (the last one never forwarded).
    assert union + n_out - 1 <= used["small"] <= union + n_out, (used, union)
    assert used["union"] == used["small"] and stats["union"] == stats["small"]
    lp = {name: _logprobs(o) for name, o in outs.items()}
    assert abs(lp["small"][0] - lp["union"][0]) < 1e-5
    assert max(abs(x - y) for x, y in zip(lp["small"][1:], lp["union"][1:])) > 1e-3


def test_continuation_prefill_reads_each_layers_set(pyramid_servers: dict) -> None:
    """A Chain Cache turn: the next prompt's tokens attend to the resumed prefix through each layer's own set
    (restored from the tree's payload), not the union: its first token already differs from the control's,
    while the cached prefix and the slots are the same."""
    first = _ids(random.Random(3), 1500)  # past the first layer's budget (976 at 1,500): the union drops some
    outs = {}
    for name in ("small", "union"):
        server = pyramid_servers[name]
        base = _flush(server)
        t1 = server.generate(input_ids=first, max_new_tokens=1, ignore_eos=True)
        history = first + t1["output_ids"] + _ids(random.Random(5), 40)
        outs[name] = _generate_with_logprobs(server, history, 1)
        meta = outs[name]["meta_info"]
        assert len(first) <= meta["cached_tokens"] <= len(first) + 1, meta  # the whole first turn is reused
        st = _assert_idle_and_sound(server)
        assert st["chain_hits_total"] - base["chain_hits_total"] == 1
    lp = {name: _logprobs(o)[0] for name, o in outs.items()}
    assert abs(lp["small"] - lp["union"]) > 1e-4, lp


def test_no_slot_is_freed_while_the_first_layer_keeps_everything(pyramid_servers: dict) -> None:
    """Between the budget and the first layer's cap (``2 (budget - fixed) - (budget - fixed) / beta + fixed`` =
    976 here) the first layer keeps the whole context, so the union is everything: the later layers read less,
    but no slot is freed (the memory PyramidKV saves is the union's, reported as such)."""
    server = pyramid_servers["small"]
    before = _flush(server)
    out = server.generate(input_ids=_ids(random.Random(11), 900), max_new_tokens=8, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 8
    after = _assert_idle_and_sound(server)
    assert after["evicted_tokens_total"] == before["evicted_tokens_total"]
    assert after["method_stats"]["selections"] == before.get("method_stats", {}).get("selections", 0) + 1
    assert after["method_stats"]["last_layer_budgets"][0] == 900
    assert after["kv_slots_used"] - before["kv_slots_used"] >= 900


def test_chain_cache_three_turns(pyramid_servers: dict) -> None:
    server = pyramid_servers["small"]
    base = _flush(server)
    rng = random.Random(9)
    history, prev_len = _ids(rng, 1200), None  # the first layer keeps at most 976 of it: the union drops some
    for turn in range(3):
        out = server.generate(input_ids=history, max_new_tokens=20, ignore_eos=True)
        meta = out["meta_info"]
        if prev_len is not None:  # the whole previous sequence matches; only the new suffix is prefilled
            assert meta["cached_tokens"] == prev_len, (turn, meta, prev_len)
            assert meta["prompt_tokens"] - meta["cached_tokens"] == 41  # the last answer token and 40 new
        st = _assert_idle_and_sound(server)
        # Bounded by the layer budgets' sum at this length plus what was decoded since the last selection.
        bound = sum(layer_budgets(len(history) + 20, LAYERS, SMALL["budget"], 24, 20, 16)) + 20
        assert st["kv_slots_used"] - base["kv_slots_used"] <= bound, (turn, st)
        prev_len = written(len(history), out["output_ids"])
        history = history + out["output_ids"] + _ids(rng, 40)
    st = _state(server)
    assert st["chain_hits_total"] - base["chain_hits_total"] == 2
    assert st["method_stats"]["resumed_without_layer_sets"] == base.get("method_stats", {}).get(
        "resumed_without_layer_sets", 0)


def test_a_continuation_prunes_its_own_prompt(pyramid_servers: dict) -> None:
    """Turn 2 resumes turn 1's per-layer sets and prunes ranges of turn 1's prompt (some positions already
    evicted) and of its own (custom_params sgl_sparse_prune): the restored masks lose exactly those columns before
    the layers score (on_prune), so turn 2 selects, finishes and leaves sets that turn 3 restores whole; the ranges
    stay hidden, nothing leaks."""
    server = pyramid_servers["small"]
    base = _flush(server)
    rng = random.Random(12)
    history = _ids(rng, 1200)
    first = server.generate(input_ids=history, max_new_tokens=10, ignore_eos=True)
    seq = history + first["output_ids"]
    history = seq + _ids(rng, 60)
    ranges = [[100, 400], [1215, 1240]]
    cp = {"sgl_sparse_prune": json.dumps({"ranges": ranges})}
    second = server.generate(input_ids=history, max_new_tokens=10, ignore_eos=True, custom_params=cp)
    assert second["meta_info"]["cached_tokens"] >= len(seq) - 1, second["meta_info"]
    seq = history + second["output_ids"]
    inspect = requests.post(f"{server.base_url}/v1/prefix_cache/inspect", json={"token_ids": seq}, timeout=60).json()
    hidden = {p for lo, hi in inspect["hidden_ranges"] for p in range(lo, hi)}
    assert {p for lo, hi in ranges for p in range(lo, hi)} <= hidden, inspect["hidden_ranges"]
    _assert_idle_and_sound(server)
    third = server.generate(input_ids=seq + _ids(rng, 20), max_new_tokens=4, ignore_eos=True)
    assert third["meta_info"]["cached_tokens"] == inspect["matched_tokens"], third["meta_info"]
    st = _assert_idle_and_sound(server)
    assert st["chain_hits_total"] - base["chain_hits_total"] == 2
    assert st["method_stats"]["resumed_without_layer_sets"] == base.get("method_stats", {}).get(
        "resumed_without_layer_sets", 0)


def test_concurrent_sessions_do_not_leak(pyramid_servers: dict) -> None:
    server = pyramid_servers["small"]
    rng = random.Random(13)
    sessions = [(_ids(rng, rng.randrange(10, 1200)), rng.randrange(1, 4), rng.randrange(1, 40)) for _ in range(12)]

    def run(session: tuple[list[int], int, int]) -> int:
        history, turns, n_out = session
        local = random.Random(len(history))
        for _ in range(turns):
            out = server.generate(input_ids=history, max_new_tokens=n_out, ignore_eos=True)
            assert out["meta_info"]["completion_tokens"] == n_out
            history = history + out["output_ids"] + [local.randrange(8, 2048) for _ in range(local.randrange(1, 80))]
        return turns

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(run, sessions)) >= 12
    assert _assert_idle_and_sound(server)["evicted_tokens_total"] > 0


def test_aborts_mid_prefill_and_mid_decode_do_not_leak(pyramid_servers: dict) -> None:
    abort_mid_prefill_and_mid_decode(pyramid_servers["small"], random.Random(4), "pyramidkv")


def test_an_answer_alone_equals_beside_and_after_other_traffic(pyramid_servers: dict) -> None:
    alone_equals_beside_traffic(pyramid_servers["small"], random.Random(46), 800)
