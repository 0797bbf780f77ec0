"""H2O through real SGLang servers on CPU (our launcher, tiny model): one H2O server and a dense one. Dense token
for token while the budget covers the context (prompts longer than the 128-query window, decode past a window: every
score is computed, nothing evicted), KV slots bounded by the budget while decode keeps evicting, Chain Cache turns,
concurrency and aborts without a leak (SGLang's strict idle check is on).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, Spec, spec
from tests.test_eviction_e2e import (
    _assert_idle_and_sound,
    _flush,
    _ids,
    _state,
    abort_mid_prefill_and_mid_decode,
    alone_equals_beside_traffic,
    covering_budget_equals_dense,
    written,
)

pytestmark = pytest.mark.server

FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]
# The default window (128 queries): decode is scored every 128 decoded tokens, and before each eviction check
# (every 16) once over the budget.
SMALL = {"budget": 512, "recent_ratio": 0.5, "evict_interval": 16}


def _server(model: str, method: str, config: dict | None = None) -> Spec:
    extra = ["--sparse-config", json.dumps(config)] if config is not None else []
    return spec(model, [*FLAGS, "--sparse-method", method, *extra], startup_timeout=900)


@pytest.fixture(scope="module")
def h2o_servers(server_pool: ServerPool, servers: dict[str, ServerProcess],
                tiny_model: str) -> Iterator[dict[str, ServerProcess]]:
    with server_pool.use(_server(tiny_model, "h2o", SMALL), once=True) as (small,):
        yield {"dense": servers["ours"], "small": small}


def test_server_info_reports_h2o(h2o_servers: dict) -> None:
    st = _state(h2o_servers["small"])
    assert st["method"] == "h2o" and st["family"] == "eviction"
    assert st["config"] == {**SMALL, "window_size": 128, "carry_scores": False}
    # Its decode queries go to the device ring: 128 a request row, every layer's query heads (the tiny model's).
    assert st["decode_window"] == 128 and st["decode_ring_bytes"] > 0
    assert _state(h2o_servers["dense"])["decode_ring_bytes"] == 0  # a dense server keeps none


def test_budget_covering_context_equals_dense(h2o_servers: dict) -> None:
    """Contexts within the budget: prompts longer than the 128-query window (several 128-token chunks), a decode
    past a window: every score is computed, nothing is evicted, the tokens are dense's."""
    covering_budget_equals_dense(h2o_servers, ((40, 24), (200, 150), (450, 60)))


def test_small_budget_bounds_kv_slots_while_decoding(h2o_servers: dict) -> None:
    server = h2o_servers["small"]
    before = _flush(server)
    out = server.generate(input_ids=_ids(random.Random(1), 1500), max_new_tokens=200, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 200
    after = _assert_idle_and_sound(server)
    used = after["kv_slots_used"] - before["kv_slots_used"]
    # Compacted to the budget at the prompt's end and every 16 decoded tokens once over it.
    assert SMALL["budget"] <= used <= SMALL["budget"] + SMALL["evict_interval"], used
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] >= 1699 - used  # written(1500, 200 tokens)
    assert after["eviction_steps_total"] - before["eviction_steps_total"] >= 1 + 200 // 16 - 1


def test_chain_cache_three_turns(h2o_servers: dict) -> None:
    server = h2o_servers["small"]
    base = _flush(server)
    rng = random.Random(9)
    history, prev_len = _ids(rng, 700), None
    for turn in range(3):
        out = server.generate(input_ids=history, max_new_tokens=20, ignore_eos=True)
        meta = out["meta_info"]
        if prev_len is not None:  # the whole previous sequence matches; only the new suffix is prefilled
            assert meta["cached_tokens"] == prev_len, (turn, meta, prev_len)
            assert meta["prompt_tokens"] - meta["cached_tokens"] == 41  # the last answer token and 40 new
        st = _assert_idle_and_sound(server)
        assert st["kv_slots_used"] - base["kv_slots_used"] <= SMALL["budget"] + SMALL["evict_interval"], (turn, st)
        prev_len = written(len(history), out["output_ids"])
        history = history + out["output_ids"] + _ids(rng, 40)
    assert _state(server)["chain_hits_total"] - base["chain_hits_total"] == 2


def test_concurrent_sessions_do_not_leak(h2o_servers: dict) -> None:
    server = h2o_servers["small"]
    rng = random.Random(13)
    sessions = [(_ids(rng, rng.randrange(10, 900)), rng.randrange(1, 4), rng.randrange(1, 40)) for _ in range(12)]

    def run(session: tuple[list[int], int, int]) -> int:
        history, turns, n_out = session
        local = random.Random(len(history))
        for _ in range(turns):
            out = server.generate(input_ids=history, max_new_tokens=n_out, ignore_eos=True)
            assert out["meta_info"]["completion_tokens"] == n_out
            history = history + out["output_ids"] + [local.randrange(8, 2048) for _ in range(local.randrange(1, 80))]
        return turns

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(run, sessions)) >= 12
    assert _assert_idle_and_sound(server)["evicted_tokens_total"] > 0


def test_aborts_mid_prefill_and_mid_decode_do_not_leak(h2o_servers: dict) -> None:
    abort_mid_prefill_and_mid_decode(h2o_servers["small"], random.Random(4), "h2o")


@pytest.fixture(scope="module")
def h2o_fp8(server_pool: ServerPool, tiny_model: str) -> Iterator[ServerProcess]:
    with server_pool.use(_server(tiny_model, "h2o+fp8_kv", {"h2o": SMALL}), once=True) as (proc,):
        yield proc


def test_h2o_over_fp8_kv_scores_the_stores_keys_and_bounds_slots(h2o_fp8: ServerProcess) -> None:
    """A composition: H2O decides what stays, scoring the keys as the FP8 store holds them; the pool holds
    about the budget, and nothing leaks (aborts included)."""
    st = _state(h2o_fp8)
    assert st["method"] == "h2o+fp8_kv" and st["config"]["h2o"]["budget"] == SMALL["budget"]
    before = _flush(h2o_fp8)
    out = h2o_fp8.generate(input_ids=_ids(random.Random(2), 1200), max_new_tokens=100, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 100
    after = _assert_idle_and_sound(h2o_fp8)
    used = after["kv_slots_used"] - before["kv_slots_used"]
    assert SMALL["budget"] <= used <= SMALL["budget"] + SMALL["evict_interval"], used
    abort_mid_prefill_and_mid_decode(h2o_fp8, random.Random(6), "h2o-fp8")


def test_an_answer_alone_equals_beside_and_after_other_traffic(h2o_servers: dict) -> None:
    alone_equals_beside_traffic(h2o_servers["small"], random.Random(43), 800)
