"""The GPU attention path (SparseTritonBackend + the compaction kernel, decode lists from the device
live-count table) served on CPU under TRITON_INTERPRET=1, against the torch path, with evicting
StreamingLLM and Chain Cache."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, spec

pytestmark = pytest.mark.server
CONFIG = json.dumps({"sink_tokens": 8, "recent_tokens": 40, "evict_interval": 8})


@pytest.fixture(scope="module")
def paths(tiny_model: str, servers: dict[str, ServerProcess],
          server_pool: ServerPool) -> Iterator[dict[str, ServerProcess]]:
    flags = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "64", "--sparse-method", "streamingllm",
             "--sparse-config", CONFIG]
    # SGLSPARSE_CHECK_TABLES: every decode step checks the device live counts against the rows.
    with server_pool.use(
        spec(tiny_model, flags, env={"SGLSPARSE_ATTENTION_IMPL": "triton", "TRITON_INTERPRET": "1",
                                     "SGLSPARSE_CHECK_TABLES": "1"}),
        spec(tiny_model, flags, env={"SGLSPARSE_ATTENTION_IMPL": "torch"}), once=True) as (triton, torch_):
        yield {"triton": triton, "torch": torch_, "dense": servers["ours"]}


def test_backend_classes(paths: dict[str, ServerProcess]) -> None:
    for name, cls in (("triton", "SparseTritonBackend"), ("torch", "SparseTorchNativeBackend")):
        assert paths[name].server_info()["internal_states"][0]["sgl_sparse"]["attention_backend_class"] == cls


def test_triton_compacted_path_equals_torch_path_with_eviction_and_chain(paths: dict[str, ServerProcess]) -> None:
    rng = random.Random(0)
    for n in (30, 200):
        ids = [rng.randrange(8, 2048) for _ in range(n)]
        outs = {k: paths[k].generate(input_ids=ids, max_new_tokens=30, ignore_eos=True)["output_ids"]
                for k in ("triton", "torch", "dense")}
        assert outs["triton"] == outs["torch"], n
        if n == 200:  # beyond the 48-token budget: eviction must change what attention reads
            assert outs["torch"] != outs["dense"]
        follow = ids + outs["torch"] + [rng.randrange(8, 2048) for _ in range(20)]
        turn2 = {k: paths[k].generate(input_ids=follow, max_new_tokens=10, ignore_eos=True)
                 for k in ("triton", "torch")}
        assert turn2["triton"]["output_ids"] == turn2["torch"]["output_ids"]
        cached = {k: turn2[k]["meta_info"]["cached_tokens"] for k in ("triton", "torch")}
        assert cached["triton"] == cached["torch"] == n + 29, cached  # the first turn's written() positions
    state = paths["triton"].server_info()["internal_states"][0]["sgl_sparse"]
    assert state["decode_count_mismatches"] == 0, state
