"""OmniKV on the GPU: servers (FlashInfer base, filter layers' token selection read through the
head-flattened wrapper) against vanilla FlashInfer and against themselves without CUDA graphs. Its
kernels' GPU test is in test_gpu_selection.py. Own module, so that its servers and Quest's do not all
hold the GPU at once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gpu_common import check_covering_equals_vanilla, check_graphs_equal_eager, selection_servers

from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu

# The 6-layer model: layers 1 and 3 filter; 2, 4 and 5 read their selections.
COVERING = {"token_budget": 16384, "sink_tokens": 64, "recent_tokens": 512, "filter_layers": "1,3"}
SMALL = {"token_budget": 1024, "sink_tokens": 64, "recent_tokens": 256, "filter_layers": "1,3"}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = selection_servers("omnikv", COVERING, SMALL)
    with running(*procs.values()):
        yield procs


def test_omnikv_covering_the_context_equals_vanilla(servers: dict[str, ServerProcess]) -> None:
    check_covering_equals_vanilla(servers, "omnikv", 600)


def test_omnikv_cuda_graphs_on_and_off_give_the_same_tokens(servers: dict[str, ServerProcess]) -> None:
    check_graphs_equal_eager(servers, "omnikv", 700)
