"""The selection family (Quest, OmniKV, RetroInfer) through real SGLang servers on CPU (our launcher; the tiny model,
and the small trained one).

Both keep every KV entry and read, per decode step, layer and KV head, only the selected tokens: Quest
whole pages (the server runs SGLang's paged allocator at page size 16, set by the launcher), OmniKV
tokens its filter layers picked. Radix prefix caching works as for dense. SGLang's strict idle leak
check is on; each test ends on a healthy, idle, sound server.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, spec
from tests.test_eviction_e2e import (
    _assert_idle_and_sound,
    _ids,
    abort_mid_prefill_and_mid_decode,
    alone_equals_beside_traffic,
)

pytestmark = pytest.mark.server

FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128"]
# Every layer selects (Quest: dense_layers 0; OmniKV: filter layers 0 and 2, each read by the next layer);
# 2,048 tokens cover every prompt here, 128 covers few.
BUDGETS = {"full": {"token_budget": 2048, "sink_tokens": 16, "recent_tokens": 32},
           "small": {"token_budget": 128, "sink_tokens": 16, "recent_tokens": 32}}
LAYERS = {"quest": {"dense_layers": 0}, "omnikv": {"filter_layers": "0,2"}}
# RetroInfer at this scale: 64-token segments of 4 clusters, an index from 128 clustered tokens on;
# "full" retrieves every cluster, "small" keeps the original's ratios (at 1,000 tokens: 1 cluster
# read, 14 estimated, of 60; plus the 16 sink and up to 96 tail tokens).
RETRO = {"segment_tokens": 64, "cluster_size": 16, "min_index_tokens": 128, "sink_tokens": 16, "recent_tokens": 32}
CONFIGS = {**{m: {name: {**b, **LAYERS[m]} for name, b in BUDGETS.items()} for m in LAYERS},
           "retroinfer": {"full": {**RETRO, "retrieval_ratio": 1.0, "estimation_ratio": 0.0}, "small": RETRO}}
PAGE = {"quest": 16, "omnikv": 1, "retroinfer": 16}


@pytest.fixture(scope="module", params=["quest", "omnikv", "retroinfer"])
def selection_servers(request: pytest.FixtureRequest, tiny_model: str, server_pool: ServerPool,
                      servers: dict[str, ServerProcess]) -> Iterator[dict[str, ServerProcess]]:
    method = request.param
    names = list(CONFIGS[method])
    specs = [spec(tiny_model, [*FLAGS, "--sparse-method", method, "--sparse-config", json.dumps(CONFIGS[method][n])])
             for n in names]
    with server_pool.use(*specs, once=True) as started:
        yield {**dict(zip(names, started)), "vanilla": servers["vanilla"], "dense": servers["ours"],
               "method": method}  # type: ignore[dict-item]


def _gen(server: ServerProcess, ids: list[int], n: int = 24) -> dict:
    return server.generate(input_ids=ids, max_new_tokens=n, ignore_eos=True)


def test_budget_covering_context_equals_dense_and_vanilla(selection_servers: dict) -> None:
    """Every token selected: the selection path (metadata, scores, top-k, masked attention) gives the
    dense tokens, for single requests and a concurrent batch of mixed lengths."""
    rng = random.Random(11)
    prompts = [_ids(rng, n) for n in (5, 16, 17, 100, 700, 1500)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = {name: list(pool.map(lambda ids, s=selection_servers[name]: _gen(s, ids)["output_ids"], prompts))
                for name in ("full", "dense", "vanilla")}
    assert outs["full"] == outs["dense"] == outs["vanilla"]
    _assert_idle_and_sound(selection_servers["full"])


def test_small_budget_reads_fewer_keys_and_changes_outputs(selection_servers: dict) -> None:
    """128 of ~1,000 tokens per step: the tiny model's diffuse attention then gives other tokens than
    dense (so the selection is really applied), while a prompt within the budget still matches dense."""
    rng = random.Random(12)
    long = [_ids(rng, 1000) for _ in range(3)]
    small, dense = selection_servers["small"], selection_servers["dense"]
    differ = sum(_gen(small, ids)["output_ids"] != _gen(dense, ids)["output_ids"] for ids in long)
    assert differ >= 1
    short = _ids(rng, 100)
    assert _gen(small, short, 8)["output_ids"] == _gen(dense, short, 8)["output_ids"]
    _assert_idle_and_sound(small)


def test_prefix_cache_reuses_whole_pages(selection_servers: dict) -> None:
    """Multi-turn: the next turn matches the previous one's KV through the radix tree (page-aligned
    cached_tokens for Quest) and still answers as dense."""
    server, rng = selection_servers["full"], random.Random(13)
    history = _ids(rng, 300)
    for _ in range(3):
        out = _gen(server, history, 16)
        ref = _gen(selection_servers["dense"], history, 16)
        assert out["output_ids"] == ref["output_ids"]
        history = history + out["output_ids"] + _ids(rng, 50)
    again = _gen(server, history, 4)
    cached = again["meta_info"]["cached_tokens"]
    assert cached > 300 and cached % PAGE[selection_servers["method"]] == 0, again["meta_info"]
    _assert_idle_and_sound(server)


def test_aborts_and_random_sessions_do_not_leak(selection_servers: dict) -> None:
    server = selection_servers["small"]
    abort_mid_prefill_and_mid_decode(server, random.Random(14), selection_servers["method"])

    def run(seed: int) -> int:
        local = random.Random(seed)
        history = _ids(local, local.randrange(10, 700))
        for _ in range(local.randrange(1, 4)):
            out = _gen(server, history, local.randrange(1, 30))
            history = history + out["output_ids"] + _ids(local, local.randrange(1, 60))
        return 1

    with ThreadPoolExecutor(6) as pool:
        assert sum(pool.map(run, range(24))) == 24
    _assert_idle_and_sound(server)


# The small trained model (4 layers): Quest reads 128 tokens (12.5%) in layers 1-3; OmniKV 512 (50%) in
# layers 2-3, from layer 1's scores. OmniKV's one token set per request, shared by heads and layers, needs
# more on this 4-layer model (this slice: 0.58 at 256; with layer 0 as the filter, random's 0.21; QUALITY.md).
# RetroInfer in layers 1-3 with 64-token segments: per KV head ~112 tokens exact (16 sink, the tail, 6 of
# 60 clusters) and 14 clusters estimated at 1,024 tokens (measured: 0.79 against random's 0.21).
SUITE = {"quest": ({**BUDGETS["small"], "dense_layers": 1}, ("bounds", "random"), 0.85),
         "omnikv": ({"token_budget": 512, "sink_tokens": 16, "recent_tokens": 32, "filter_layers": "1"},
                    ("max_logit", "random"), 0.7),
         "retroinfer": ({**RETRO, "retrieval_ratio": 0.1, "dense_layers": 1}, ("centroids", "random"), 0.7)}


@pytest.mark.parametrize("method", ["quest", "omnikv", "retroinfer"])
def test_small_budget_answers_the_suite_and_random_selection_does_not(method: str, server_pool: ServerPool,
                                                                      small_suite: tuple[str, list]) -> None:
    """The small trained model on the suite's short slice (every task, 4 examples, 1,024 tokens; the agent
    task as a multi-turn session): the method's selection answers well above a random selection under the
    same budget (measured: Quest 1.00 vs 0.21, OmniKV 0.83 vs 0.29, RetroInfer 0.79 vs 0.21)."""
    from sgl_sparse.quality.eval import evaluate

    model, items = small_suite
    base, scorings, bar = SUITE[method]
    specs = [spec(model, [*CPU_SERVER_FLAGS, "--sparse-method", method, "--sparse-config",
                          json.dumps({**base, "scoring": scoring})]) for scoring in scorings]
    acc = {}
    with server_pool.use(*specs, once=True) as started:
        for scoring, srv in zip(scorings, started):
            table = evaluate(srv.base_url, items)
            _assert_idle_and_sound(srv)
            acc[scoring] = sum(r["correct"] for r in table.values()) / sum(r["n"] for r in table.values())
    method_acc, random_acc = (acc[s] for s in scorings)
    assert method_acc >= bar and random_acc <= 0.5, acc


def test_an_answer_alone_equals_beside_and_after_other_traffic(selection_servers: dict) -> None:
    alone_equals_beside_traffic(selection_servers["small"], random.Random(48), 700)
