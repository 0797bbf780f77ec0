"""An eviction method over a quantized pool on the GPU (``snapkv+fp8_kv``): the store's decode reads FlashInfer's
compacted decode lists as rows (``store_attention.flat_rows``), built by our index launcher from the live counts
and replayed by CUDA graphs, where the CPU server sorts each row per step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpu_common import SELECTION_LENS, assert_idle_and_sound, assert_same_tokens, generate, ours, prose, state

from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu
SYNC = {"SGLSPARSE_SYNC_DEBUG": "error"}
COVERING = {"snapkv": {"budget": 16384}}  # above every prompt + output here: nothing is evicted
SMALL = {"snapkv": {"budget": 1024}}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {
        "fp8": ours("compose-fp8", "fp8_kv"),
        "covering": ours("compose-covering", "snapkv+fp8_kv", COVERING, env=SYNC),
        "small": ours("compose-small", "snapkv+fp8_kv", SMALL, env=SYNC),
        "small-eager": ours("compose-small-eager", "snapkv+fp8_kv", SMALL, extra=["--disable-cuda-graph"]),
    }
    with running(*procs.values()):
        yield procs


def test_a_covering_budget_serves_exactly_the_store_alone(servers: dict[str, ServerProcess]) -> None:
    """Nothing evicted: every request reads the same FP8 slots through the compacted lists as fp8_kv alone reads
    through its rows, so the tokens are the same."""
    prompts = [prose(1100 + i, n) for i, n in enumerate(SELECTION_LENS)]
    # Chunked prompts (2,048 a chunk): later chunks read the compacted prefix dequantized, as fp8_kv alone does.
    assert state(servers["covering"])["kv_store"]["prefix_attention"] == "dequantize"
    before = state(servers["covering"])["evicted_tokens_total"]
    assert_same_tokens(generate(servers["fp8"], prompts, 64), generate(servers["covering"], prompts, 64),
                       "fp8_kv", "snapkv+fp8_kv covering", "batch of 5")
    assert state(servers["covering"])["evicted_tokens_total"] == before
    assert_idle_and_sound(servers["covering"])


def test_a_small_budget_evicts_and_graphs_equal_eager(servers: dict[str, ServerProcess]) -> None:
    """SnapKV 1,024 over FP8: each request keeps its budget, the graph server (our decode code raising on a host
    sync) gives the eager server's tokens, and nothing leaks."""
    prompts = [prose(1200 + i, n) for i, n in enumerate(SELECTION_LENS)]
    before = state(servers["small"])["evicted_tokens_total"]
    eager = generate(servers["small-eager"], prompts, 96)
    graph = generate(servers["small"], prompts, 96)
    assert_same_tokens(eager, graph, "snapkv+fp8_kv eager", "snapkv+fp8_kv graph", "batch of 5")
    assert state(servers["small"])["evicted_tokens_total"] > before
    for name in ("small", "small-eager"):
        assert_idle_and_sound(servers[name])
