"""H2O, R-KV and SkipKV on the GPU (FlashInfer base; their CPU server tests check them against plain-torch
references): a covering budget serves vanilla FlashInfer's tokens; a small budget evicts at the prompt's end and
during decode (every ``evict_interval`` tokens), scoring decode queries that the decode CUDA graph writes into the
device ring (integration/capture.py), and ends idle and sound; its tokens equal its eager twin's
(``--disable-cuda-graph``), and its graph server raises on a host sync in our decode-step code.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpu_common import (
    SELECTION_LENS,
    assert_idle_and_sound,
    assert_same_tokens,
    decode_lines,
    generate,
    log_mark,
    log_since,
    ours,
    prose,
    state,
    vanilla,
)

from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu

SMALL = {
    "h2o": {"budget": 1024, "evict_interval": 64},
    "rkv": {"budget": 1024, "evict_interval": 64},
    "skipkv": {"budget": 1024, "evict_interval": 64},
}
COVERING = {"h2o": {"budget": 16384}, "rkv": {"budget": 16384}, "skipkv": {"budget": 16384}}
OUT = 160  # compactions every 64 decoded tokens once over budget: two during decode


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {"vanilla": vanilla("new-evict-vanilla-flashinfer")}
    for m in SMALL:
        procs[f"{m}:covering"] = ours(f"new-evict-{m}-covering", m, COVERING[m])
        procs[f"{m}:small"] = ours(f"new-evict-{m}-small", m, SMALL[m], env={"SGLSPARSE_SYNC_DEBUG": "error"})
        procs[f"{m}:small-eager"] = ours(f"new-evict-{m}-small-eager", m, SMALL[m], extra=["--disable-cuda-graph"])
    with running(*procs.values()):
        yield procs


@pytest.mark.parametrize("method", list(SMALL))
def test_a_covering_budget_serves_vanillas_tokens(servers: dict[str, ServerProcess], method: str) -> None:
    prompts = [prose(1600 + i, n) for i, n in enumerate(SELECTION_LENS)]
    srv = servers[f"{method}:covering"]
    before = state(srv)["evicted_tokens_total"]
    assert_same_tokens(generate(servers["vanilla"], prompts, 64), generate(srv, prompts, 64), "vanilla",
                       f"{method} covering", "batch of 5")
    assert state(srv)["evicted_tokens_total"] == before
    assert_idle_and_sound(srv)


@pytest.mark.parametrize("method", list(SMALL))
def test_a_small_budget_evicts_in_decode_graphs_as_eagerly_and_leaks_nothing(servers: dict[str, ServerProcess],
                                                                            method: str) -> None:
    prompts = [prose(1700 + i, n) for i, n in enumerate(SELECTION_LENS)]
    srv, eager = servers[f"{method}:small"], servers[f"{method}:small-eager"]
    before = state(srv)["evicted_tokens_total"]
    mark = log_mark(srv)
    outs = generate(srv, prompts, OUT)
    evicted = state(srv)["evicted_tokens_total"] - before
    # At least the prompts' excess over the budget and their decoded tokens past it.
    least = sum(SELECTION_LENS) - len(prompts) * SMALL[method]["budget"] + len(prompts) * 64
    assert evicted >= least, (method, evicted, least)
    assert all(len(o.ids) == OUT for o in outs)
    assert any(graph for _, graph in decode_lines(log_since(srv, mark))), "no decode step replayed a CUDA graph"
    assert_idle_and_sound(srv)
    assert_same_tokens(generate(eager, prompts, OUT), outs, f"{method} eager", f"{method} graph", "batch of 5")
    assert_idle_and_sound(eager)
