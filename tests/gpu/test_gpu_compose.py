"""An eviction method over a quantized pool on the GPU (``snapkv+fp8_kv``): the store's decode reads FlashInfer's
compacted decode lists as rows (``store_attention.flat_rows``), built by our index launcher from the live counts
and replayed by CUDA graphs, where the CPU server sorts each row per step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpu_common import (
    COMPOSE_COVERING,
    COMPOSE_SMALL,
    check_composition_evicts_and_graphs_equal_eager,
    check_covering_equals_store,
    ours,
    state,
)

from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu
SYNC = {"SGLSPARSE_SYNC_DEBUG": "error"}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {
        "fp8": ours("compose-fp8", "fp8_kv"),
        "covering": ours("compose-covering", "snapkv+fp8_kv", COMPOSE_COVERING, env=SYNC),
        "small": ours("compose-small", "snapkv+fp8_kv", COMPOSE_SMALL, env=SYNC),
        "small-eager": ours("compose-small-eager", "snapkv+fp8_kv", COMPOSE_SMALL, extra=["--disable-cuda-graph"]),
    }
    with running(*procs.values()):
        yield procs


def test_a_covering_budget_serves_exactly_the_store_alone(servers: dict[str, ServerProcess]) -> None:
    """Nothing evicted: every request reads the same FP8 slots through the compacted lists as fp8_kv alone reads
    through its rows, so the tokens are the same."""
    # Chunked prompts (2,048 a chunk): later chunks read the compacted prefix dequantized, as fp8_kv alone does.
    assert state(servers["covering"])["kv_store"]["prefix_attention"] == "dequantize"
    check_covering_equals_store(servers, "fp8", "snapkv+fp8_kv", 1100)


def test_a_small_budget_evicts_and_graphs_equal_eager(servers: dict[str, ServerProcess]) -> None:
    """SnapKV 1,024 over FP8: each request keeps its budget, the graph server (our decode code raising on a host
    sync) gives the eager server's tokens, and nothing leaks."""
    check_composition_evicts_and_graphs_equal_eager(servers, "snapkv+fp8_kv", 1200)
