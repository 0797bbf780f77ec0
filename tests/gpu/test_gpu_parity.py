"""Parity on the GPU: ``dense`` through our launcher equals vanilla SGLang on FlashInfer, and SnapKV /
StreamingLLM with a budget covering the whole context equal ``dense``, token for token (greedy, bf16,
quality-large). Four servers, started together.

Each server runs the same workload, in the same order: a batch of 5 prompts of 2-4K tokens (decode at
batch 5: CUDA graph of 8 with padding), their second turns (prompt + output + new text: a prefix-cache /
Chain Cache hit), then two prompts one at a time (decode at batch 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gpu_common import (
    assert_idle_and_sound,
    assert_same_tokens,
    flush_and_check_empty,
    generate,
    ours,
    prose,
    state,
    vanilla,
)

from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu

BATCH_LENS = [2048, 2900, 3500, 4000, 3100]
SINGLE_LENS = [3300, 2500]
NEW_TURN_TOKENS = 300
OUT = 128
# Budgets above every logical length here (at most 4000 + 128 + 300 + 128 tokens).
COVERING = {
    "snapkv": {"budget": 8192, "window_size": 32, "sink_tokens": 64},
    "streamingllm": {"sink_tokens": 64, "recent_tokens": 8192, "evict_interval": 64},
}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {
        "vanilla": vanilla("parity-vanilla-flashinfer"),
        "dense": ours("parity-dense"),
        **{m: ours(f"parity-{m}-covering", m, cfg) for m, cfg in COVERING.items()},
    }
    with running(*procs.values()):
        yield procs


@pytest.fixture(scope="module")
def workload(servers: dict[str, ServerProcess]) -> Any:
    """``workload(name)``: that server's outputs of the module workload, run once (and counters around it)."""
    batch = [prose(100 + i, n) for i, n in enumerate(BATCH_LENS)]
    singles = [prose(200 + i, n) for i, n in enumerate(SINGLE_LENS)]
    done: dict[str, dict[str, Any]] = {}

    def run(name: str) -> dict[str, Any]:
        if name not in done:
            srv = servers[name]
            before = state(srv) if name != "vanilla" else None
            turn1 = generate(srv, batch, OUT)
            turn2_prompts = [p + o.ids + prose(300 + i, NEW_TURN_TOKENS) for i, (p, o) in enumerate(zip(batch, turn1))]
            turn2 = generate(srv, turn2_prompts, OUT)
            single = [generate(srv, [p], OUT)[0] for p in singles]
            after = state(srv) if name != "vanilla" else None
            done[name] = {"turn1": turn1, "turn2": turn2, "single": single, "before": before, "after": after}
        return done[name]

    return run


def _labels(lens: list[int]) -> list[str]:
    return [f"{n}-token prompt" for n in lens]


def test_servers_are_what_they_claim(servers: dict[str, ServerProcess]) -> None:
    info = servers["vanilla"].server_info()
    assert info["attention_backend"] == "flashinfer", info["attention_backend"]
    assert "sgl_sparse" not in info["internal_states"][0]
    for name in ("dense", *COVERING):
        st = state(servers[name])
        assert (st["method"], st["attention_base"], st["attention_backend_class"], st["tree_class"]) == (
            name, "flashinfer", "SparseFlashInferBackend", "SparseRadixCache"), st


def test_dense_equals_vanilla_flashinfer_concurrent_batch(workload: Any) -> None:
    assert_same_tokens(workload("vanilla")["turn1"], workload("dense")["turn1"], "vanilla flashinfer", "ours dense",
                       "batch of 5 concurrent requests", _labels(BATCH_LENS))


def test_dense_equals_vanilla_flashinfer_second_turn_from_the_prefix_cache(workload: Any) -> None:
    v, d = workload("vanilla")["turn2"], workload("dense")["turn2"]
    assert_same_tokens(v, d, "vanilla flashinfer", "ours dense", "second turns (prefix-cache hits), batch of 5",
                       _labels(BATCH_LENS))
    assert [o.meta["cached_tokens"] for o in d] == [o.meta["cached_tokens"] for o in v]
    for n, o in zip(BATCH_LENS, d):  # the whole first turn, less at most its last token, comes from the tree
        assert o.meta["cached_tokens"] >= n + OUT - 1, (n, o.meta["cached_tokens"])


def test_dense_equals_vanilla_flashinfer_one_at_a_time(workload: Any) -> None:
    assert_same_tokens(workload("vanilla")["single"], workload("dense")["single"], "vanilla flashinfer",
                       "ours dense", "single requests", _labels(SINGLE_LENS))


@pytest.mark.parametrize("method", list(COVERING))
def test_budget_covering_the_context_equals_dense(workload: Any, method: str) -> None:
    d, m = workload("dense"), workload(method)
    name = f"{method} {COVERING[method]}"
    evicted = m["after"]["evicted_tokens_total"] - m["before"]["evicted_tokens_total"]
    assert evicted == 0, f"{name}: the budget covers every context here, yet {evicted} tokens were evicted"
    for part, what in (("turn1", "batch of 5"), ("turn2", "second turns, batch of 5"), ("single", "single requests")):
        labels = _labels(SINGLE_LENS if part == "single" else BATCH_LENS)
        assert_same_tokens(d[part], m[part], "ours dense", name, what, labels)
    assert [o.meta["cached_tokens"] for o in m["turn2"]] == [o.meta["cached_tokens"] for o in d["turn2"]]


def test_servers_end_idle_sound_and_flushable(servers: dict[str, ServerProcess], workload: Any) -> None:
    for name in ("dense", *COVERING):
        workload(name)  # run even when the tests above were deselected
        srv = servers[name]
        assert_idle_and_sound(srv)
        flush_and_check_empty(srv)
        assert_idle_and_sound(srv)
