"""H2O, R-KV and SkipKV on the GPU (FlashInfer base; their CPU server tests check them against plain-torch
references): a covering budget serves vanilla FlashInfer's tokens; a small budget evicts at the prompt's end (and
R-KV / SkipKV during decode, every ``evict_interval`` tokens) and ends idle and sound. H2O at
``evict_interval: 0`` keeps decode CUDA graphs, whose tokens equal its eager server's; R-KV and SkipKV observe
decode queries, collected in Python, so they run with ``--cuda-graph-backend-decode disabled`` (the launcher
refuses them otherwise).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpu_common import SELECTION_LENS, assert_idle_and_sound, assert_same_tokens, generate, ours, prose, state, vanilla

from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu

NO_DECODE_GRAPH = ["--cuda-graph-backend-decode", "disabled"]
SMALL = {
    "h2o": {"budget": 1024, "evict_interval": 0},
    "rkv": {"budget": 1024, "evict_interval": 64},
    "skipkv": {"budget": 1024, "evict_interval": 64},
}
COVERING = {"h2o": {"budget": 16384, "evict_interval": 0}, "rkv": {"budget": 16384},
            "skipkv": {"budget": 16384}}
OUT = 160  # R-KV / SkipKV compact every 64 decoded tokens once over budget: two decode-time compactions


def _extra(method: str) -> list[str]:
    return [] if method == "h2o" else NO_DECODE_GRAPH


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {"vanilla": vanilla("new-evict-vanilla-flashinfer")}
    for m in SMALL:
        procs[f"{m}:covering"] = ours(f"new-evict-{m}-covering", m, COVERING[m], extra=_extra(m))
        procs[f"{m}:small"] = ours(f"new-evict-{m}-small", m, SMALL[m], extra=_extra(m),
                                   env={"SGLSPARSE_SYNC_DEBUG": "error"} if m == "h2o" else None)
    procs["h2o:small-eager"] = ours("new-evict-h2o-small-eager", "h2o", SMALL["h2o"], extra=["--disable-cuda-graph"])
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
def test_a_small_budget_evicts_and_leaks_nothing(servers: dict[str, ServerProcess], method: str) -> None:
    prompts = [prose(1700 + i, n) for i, n in enumerate(SELECTION_LENS)]
    srv = servers[f"{method}:small"]
    before = state(srv)["evicted_tokens_total"]
    outs = generate(srv, prompts, OUT)
    evicted = state(srv)["evicted_tokens_total"] - before
    # At least the prompts' excess over the budget; R-KV and SkipKV also their decoded tokens past it.
    least = sum(SELECTION_LENS) - len(prompts) * SMALL[method]["budget"]
    assert evicted >= least + (len(prompts) * 64 if method != "h2o" else 0), (method, evicted, least)
    assert all(len(o.ids) == OUT for o in outs)
    assert_idle_and_sound(srv)
    if method == "h2o":
        eager = generate(servers["h2o:small-eager"], prompts, OUT)
        assert_same_tokens(eager, outs, "h2o eager", "h2o graph", "batch of 5")
        assert_idle_and_sound(servers["h2o:small-eager"])
