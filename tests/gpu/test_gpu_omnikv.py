"""OmniKV on the GPU: servers (FlashInfer base, filter layers' token selection read through the
head-flattened wrapper) against vanilla FlashInfer and against themselves without CUDA graphs. Its
kernels' GPU test is in test_gpu_selection.py. Own module, so that its servers and Quest's do not all
hold the GPU at once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpu_common import assert_idle_and_sound, assert_same_tokens, generate, ours, prose, vanilla

from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu

GPU = {"SGLSPARSE_GPU_SELECTION": "1"}  # the launcher's opt-in until this file passes
# The 6-layer model: layers 1 and 3 filter; 2, 4 and 5 read their selections.
COVERING = {"token_budget": 16384, "sink_tokens": 64, "recent_tokens": 512, "filter_layers": "1,3"}
SMALL = {"token_budget": 1024, "sink_tokens": 64, "recent_tokens": 256, "filter_layers": "1,3"}
LENS = [6000, 3000, 4500, 2048, 5000]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {
        "vanilla": vanilla("omnikv-vanilla-flashinfer"),
        "covering": ours("omnikv-covering", "omnikv", COVERING, env={**GPU, "SGLSPARSE_SYNC_DEBUG": "error"}),
        "small": ours("omnikv-small-graph", "omnikv", SMALL, env={**GPU, "SGLSPARSE_SYNC_DEBUG": "error"}),
        "small-eager": ours("omnikv-small-eager", "omnikv", SMALL, extra=["--disable-cuda-graph"], env=GPU),
    }
    with running(*procs.values()):
        yield procs


def test_omnikv_covering_the_context_equals_vanilla(servers: dict[str, ServerProcess]) -> None:
    prompts = [prose(600 + i, n) for i, n in enumerate(LENS)]
    ref = generate(servers["vanilla"], prompts, 96)
    got = generate(servers["covering"], prompts, 96)
    assert_same_tokens(ref, got, "vanilla", "omnikv covering", "batch of 5")
    assert_idle_and_sound(servers["covering"])


def test_omnikv_cuda_graphs_on_and_off_give_the_same_tokens(servers: dict[str, ServerProcess]) -> None:
    prompts = [prose(700 + i, n) for i, n in enumerate(LENS)]
    eager = generate(servers["small-eager"], prompts, 96)
    graph = generate(servers["small"], prompts, 96)
    assert_same_tokens(eager, graph, "omnikv eager", "omnikv graph", "batch of 5")
    for name in ("small", "small-eager"):
        assert_idle_and_sound(servers[name])
