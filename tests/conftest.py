"""Shared fixtures: the tiny model, and real SGLang servers (ours and vanilla) on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sgl_sparse.server_process import CPU_SERVER_FLAGS, VANILLA_CPU_FLAGS, ServerProcess, running
from sgl_sparse.tiny_model import write_tiny_model

# Small chunks so that multi-chunk prefill is exercised with short prompts.
COMMON_FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def servers(tiny_model: str) -> Iterator[dict[str, ServerProcess]]:
    """Our launcher (dense) and stock ``sglang.launch_server``, same model and flags, started together."""
    ours = ServerProcess(tiny_model, COMMON_FLAGS, module="sgl_sparse.launch_server")
    vanilla = ServerProcess(tiny_model, [*COMMON_FLAGS, *VANILLA_CPU_FLAGS], module="sglang.launch_server")
    with running(ours, vanilla):
        yield {"ours": ours, "vanilla": vanilla}


@pytest.fixture(scope="session")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["ours"]


@pytest.fixture(scope="session")
def mixed_server(tiny_model: str) -> Iterator[ServerProcess]:
    """A dense server whose requests may choose any eviction method (--sparse-request-methods eviction): the
    per-request methods' and Prefix-Cache Pruning's tests share it."""
    proc = ServerProcess(tiny_model, [*COMMON_FLAGS, "--sparse-request-methods", "eviction"], startup_timeout=900)
    with running(proc):
        yield proc
