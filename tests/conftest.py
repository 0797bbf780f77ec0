"""Shared fixtures: the tiny model, the session's server pool, and the servers most files share.

Server-backed tests get their servers from one pool (tests/server_pool.py, rules in tests/README.md). With
pytest-xdist (two lanes, ``-n 2 --dist loadgroup`` in pyproject.toml) every test that uses the pool runs in one
lane, in an order that keeps users of one server together; everything else runs in the other.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_sparse.server_process import CPU_SERVER_FLAGS, VANILLA_CPU_FLAGS, ServerProcess
from sgl_sparse.tiny_model import write_tiny_model
from tests.server_pool import DEFAULT_MAX_LIVE, PREFIXED_TEMPLATE, ServerPool, Spec, spec

# Small chunks so that multi-chunk prefill is exercised with short prompts.
COMMON_FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]
SERVER_RECORD_ENV = "SGLSPARSE_TEST_SERVER_RECORD"  # JSON lines: each pooled server's start and stop seconds

# The server lane's files in the order they run: files that share servers side by side, so that the pool starts
# each server about once (files not named run after these, in collection order).
SERVER_FILE_ORDER = [
    # the session's dense and vanilla servers, and the mixed (per-request methods) server
    "test_server_e2e", "test_request_validation", "test_bench_agent", "test_quality", "test_prune_e2e",
    "test_request_methods_e2e", "test_hook_order_e2e",
    # streamingllm / snapkv / fp8_kv / kivi shared by these
    "test_eviction_e2e", "test_chain_traffic_e2e", "test_compose_e2e", "test_quant_e2e", "test_palu_e2e",
    "test_deltakv_e2e", "test_h2o_e2e", "test_rkv_e2e", "test_skipkv_e2e", "test_pyramidkv_e2e", "test_kvzip_e2e",
    "test_selection_e2e", "test_server_flags_e2e", "test_triton_backend_e2e", "test_router_e2e",
    "test_request_prune_e2e", "test_tp_e2e",
]


def _uses_servers(item: pytest.Item) -> bool:
    """Tests of the pool's servers share one lane. A test that runs a driver starting its own servers one at a time
    (the demo, ``bench_agent compare``, ``benchmarks/quality_suite.py``) runs in the other lane: one server beside
    the pool's fits the machine's memory (tests/README.md)."""
    return "server_pool" in getattr(item, "fixturenames", ())


def pytest_configure(config: pytest.Config) -> None:
    # Set in the controller before xdist starts its workers, so every lane appends to one record.
    if SERVER_RECORD_ENV not in os.environ and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="sgl-sparse-test-servers-", suffix=".jsonl")
        os.close(fd)
        os.environ[SERVER_RECORD_ENV] = path
        config._sgl_sparse_t0 = time.monotonic()  # type: ignore[attr-defined]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SERVER_FILE_ORDER)}

    def key(pair: tuple[int, pytest.Item]) -> tuple[int, int, int]:
        i, item = pair
        if not _uses_servers(item):
            return (0, 0, i)
        return (1, rank.get(Path(str(item.fspath)).stem, len(rank)), i)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group("servers" if _uses_servers(item) else "cpu"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    path = os.environ.get(SERVER_RECORD_ENV)
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()] if path and Path(path).exists() else []
    if t0 := getattr(config, "_sgl_sparse_t0", None):
        terminalreporter.write_line(f"test run wall time: {time.monotonic() - t0:.0f} s")
    if not lines:
        return
    starts = [x for x in lines if x["event"] == "start"]
    stops = [x for x in lines if x["event"] == "stop"]
    terminalreporter.section("test servers (start and stop seconds)")
    terminalreporter.write_line(f"{len(starts)} starts, {sum(x['seconds'] for x in starts):.0f} s; "
                                f"{len(stops)} stops, {sum(x['seconds'] for x in stops):.0f} s")
    for x in starts:
        stop = next((y["seconds"] for y in stops if y["server"] == x["server"] and y["at"] >= x["at"]), None)
        terminalreporter.write_line(f"  start {x['seconds']:6.1f} s  stop {stop if stop is not None else '-':>6} s"
                                    f"  {x['server']}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    pool = ServerPool(int(os.environ.get("SGLSPARSE_TEST_MAX_SERVERS", DEFAULT_MAX_LIVE)),
                      record_path=os.environ.get(SERVER_RECORD_ENV),
                      zygote=os.environ.get("SGLSPARSE_TEST_ZYGOTE", "1") != "0")
    try:
        yield pool
    finally:
        pool.close()


# The servers most files compare against start their children as SGLang does in production (spawn).
SPAWN = {"SGLSPARSE_MP_START": "spawn"}


def dense_spec(model: str) -> Spec:
    """Our launcher, dense: the server most files compare against."""
    return spec(model, COMMON_FLAGS, env=SPAWN)


def vanilla_spec(model: str) -> Spec:
    """Stock ``sglang.launch_server`` with the same model and flags as :func:`dense_spec`."""
    return spec(model, [*COMMON_FLAGS, *VANILLA_CPU_FLAGS], module="sglang.launch_server", env=SPAWN)


def mixed_spec(model: str) -> Spec:
    """A dense server whose requests may choose any eviction method (--sparse-request-methods eviction)."""
    return spec(model, [*COMMON_FLAGS, "--sparse-request-methods", "eviction"])


@pytest.fixture(scope="session")
def servers(server_pool: ServerPool, tiny_model: str) -> Iterator[dict[str, ServerProcess]]:
    """Our launcher (dense) and stock ``sglang.launch_server``, same model and flags; held for the session (most
    server files compare against them, so the pool never stops them)."""
    with server_pool.use(dense_spec(tiny_model), vanilla_spec(tiny_model)) as (ours, vanilla):
        yield {"ours": ours, "vanilla": vanilla}


@pytest.fixture(scope="session")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["ours"]


@pytest.fixture(scope="module")
def mixed_server(server_pool: ServerPool, tiny_model: str) -> Iterator[ServerProcess]:
    """The per-request methods' and Prefix-Cache Pruning's tests share it (:func:`mixed_spec`)."""
    with server_pool.use(mixed_spec(tiny_model)) as (proc,):
        yield proc


@pytest.fixture(scope="session")
def small_suite() -> tuple[str, list]:
    """The small trained model and the suite's short slice on it (every task, 4 examples, 1,024 tokens; the agent
    task as a multi-turn session), built once for the files whose methods must answer it."""
    from transformers import AutoTokenizer

    from sgl_sparse.quality.eval import build_items
    from sgl_sparse.quality.models import small_model_path
    from sgl_sparse.quality.tasks import TASKS

    model = str(small_model_path())
    return model, build_items(AutoTokenizer.from_pretrained(model), list(TASKS), 4, 1024, seed=10_000, chain=True)


@pytest.fixture(scope="session")
def prefixed_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    """:data:`PREFIXED_TEMPLATE` in a file: one path for the session, so servers that take it are one server."""
    path = tmp_path_factory.mktemp("template") / "prefixed.jinja"
    path.write_text(PREFIXED_TEMPLATE)
    return str(path)
