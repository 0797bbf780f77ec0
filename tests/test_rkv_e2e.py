"""R-KV through real SGLang servers on CPU (our launcher, tiny model): one R-KV server and a dense one. Dense token
for token while the budget covers the context, KV slots bounded by budget + evict_interval while decode keeps
compressing (a prompt over the budget compressed at its end), Chain Cache turns, concurrency and aborts without a
leak (SGLang's strict idle check is on), and R-KV over an FP8 pool (a composition).
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
SMALL = {"budget": 512, "evict_interval": 16}  # the default 8 observation tokens, pool 7, mix 0.1


def _server(model: str, method: str, config: dict | None = None) -> Spec:
    extra = ["--sparse-config", json.dumps(config)] if config is not None else []
    return spec(model, [*FLAGS, "--sparse-method", method, *extra], startup_timeout=900)


@pytest.fixture(scope="module")
def rkv_servers(server_pool: ServerPool, servers: dict[str, ServerProcess],
                tiny_model: str) -> Iterator[dict[str, ServerProcess]]:
    with server_pool.use(_server(tiny_model, "rkv", SMALL), once=True) as (small,):
        yield {"dense": servers["ours"], "small": small}


def test_server_info_reports_rkv(rkv_servers: dict) -> None:
    st = _state(rkv_servers["small"])
    assert st["method"] == "rkv" and st["family"] == "eviction"
    assert st["config"] == {**SMALL, "window_size": 8, "kernel_size": 7, "mix_lambda": 0.1,
                            "similarity_threshold": 0.5}


def test_budget_covering_context_equals_dense(rkv_servers: dict) -> None:
    """Contexts within the budget (multi-chunk prompts, decode past many intervals): queries are captured every
    step, nothing is compressed, the tokens are dense's."""
    covering_budget_equals_dense(rkv_servers, ((40, 24), (200, 150), (450, 62)))


def test_small_budget_bounds_kv_slots_while_decoding(rkv_servers: dict) -> None:
    server = rkv_servers["small"]
    before = _flush(server)
    out = server.generate(input_ids=_ids(random.Random(1), 1500), max_new_tokens=200, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 200
    after = _assert_idle_and_sound(server)
    used = after["kv_slots_used"] - before["kv_slots_used"]
    # Compressed to the budget at the prompt's end and every 16 decoded positions once over it: the 200 tokens
    # wrote 199 (written()), 12 x 16 + 7.
    assert used == SMALL["budget"] + 199 % SMALL["evict_interval"], used
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] == 1699 - used
    assert after["eviction_steps_total"] - before["eviction_steps_total"] == 1 + 199 // SMALL["evict_interval"]


def test_short_prompt_is_compressed_in_decode_only(rkv_servers: dict) -> None:
    """A prompt under the budget stays whole; decode compresses once the buffer takes it over the budget."""
    server = rkv_servers["small"]
    before = _flush(server)
    out = server.generate(input_ids=_ids(random.Random(3), 500), max_new_tokens=40, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 40
    after = _assert_idle_and_sound(server)
    # 516 at decoded 16 -> 512, 528 at 32 -> 512, then 7 more (39 of the 40 new tokens written: written()).
    assert after["kv_slots_used"] - before["kv_slots_used"] == 519
    assert after["eviction_steps_total"] - before["eviction_steps_total"] == 2


def test_chain_cache_three_turns(rkv_servers: dict) -> None:
    server = rkv_servers["small"]
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


def test_concurrent_sessions_do_not_leak(rkv_servers: dict) -> None:
    server = rkv_servers["small"]
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


def test_aborts_mid_prefill_and_mid_decode_do_not_leak(rkv_servers: dict) -> None:
    abort_mid_prefill_and_mid_decode(rkv_servers["small"], random.Random(4), "rkv")


@pytest.fixture(scope="module")
def rkv_fp8(server_pool: ServerPool, tiny_model: str) -> Iterator[ServerProcess]:
    with server_pool.use(_server(tiny_model, "rkv+fp8_kv", {"rkv": SMALL}), once=True) as (proc,):
        yield proc


def test_rkv_over_fp8_kv_scores_the_stores_keys_and_bounds_slots(rkv_fp8: ServerProcess) -> None:
    """A composition: R-KV decides what stays, scoring the keys as the FP8 store holds them; the pool holds
    about the budget, and nothing leaks (aborts included)."""
    st = _state(rkv_fp8)
    assert st["method"] == "rkv+fp8_kv" and st["config"]["rkv"]["budget"] == SMALL["budget"]
    before = _flush(rkv_fp8)
    out = rkv_fp8.generate(input_ids=_ids(random.Random(2), 1200), max_new_tokens=100, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 100
    after = _assert_idle_and_sound(rkv_fp8)
    used = after["kv_slots_used"] - before["kv_slots_used"]
    assert used == SMALL["budget"] + 99 % SMALL["evict_interval"], used  # 99 decode positions written
    abort_mid_prefill_and_mid_decode(rkv_fp8, random.Random(6), "rkv-fp8")


def test_an_answer_alone_equals_beside_and_after_other_traffic(rkv_servers: dict) -> None:
    alone_equals_beside_traffic(rkv_servers["small"], random.Random(44), 800)
