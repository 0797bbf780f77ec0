"""An eviction method over a quantization method's pool (``snapkv+fp8_kv``, ``streamingllm+turboquant``) through
real SGLang servers on CPU (our launcher, tiny model; the suite slice on the small trained model).

The eviction member decides what stays, the store holds it: eviction writes sentinels and frees single slots,
and the store reads each request's live slots through compacted rows (nothing moves in the pool). With a budget
that covers the context the composition serves the store's tokens exactly; with a lossless store it serves the
eviction method's own tokens exactly, evicting; with a small budget it holds fewer slots than logical tokens,
resumes the next turn from the compacted quantized KV (Chain Cache), and leaks nothing (SGLang's strict idle
check is on; aborts included).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, Spec, spec
from tests.test_eviction_e2e import (
    SNAPKV,
    _assert_idle_and_sound,
    _ids,
    _state,
    abort_mid_prefill_and_mid_decode,
    chain_cache_three_turns,
    snapkv_spec,
)

pytestmark = pytest.mark.server

FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]
STREAMING = {"sink_tokens": 16, "recent_tokens": 128, "evict_interval": 16}


def _server(model: str, method: str, config: dict | None = None, env: dict | None = None) -> Spec:
    extra = ["--sparse-config", json.dumps(config)] if config else []
    return spec(model, [*FLAGS, "--sparse-method", method, *extra], env=env)


@pytest.fixture(scope="module")
def compose_servers(tiny_model: str, server_pool: ServerPool,
                    prefixed_template: str) -> Iterator[dict[str, ServerProcess]]:
    plain = {"SGLSPARSE_METHOD_MODULES": "tests.plain_store"}
    specs = {
        "snapkv+fp8_kv": _server(tiny_model, "snapkv+fp8_kv", {"snapkv": SNAPKV}),
        "fp8_kv": _server(tiny_model, "fp8_kv"),  # the quantization file's fp8_kv at its default prefix read
        "streamingllm+turboquant": _server(tiny_model, "streamingllm+turboquant",
                                           {"streamingllm": STREAMING, "turboquant": {"bits": 4}}),
        "snapkv+plain_store": _server(tiny_model, "snapkv+plain_store", {"snapkv": SNAPKV}, env=plain),
        "snapkv": snapkv_spec(tiny_model, prefixed_template),  # the eviction file's (its chat template unused here)
    }
    with server_pool.use(*specs.values()) as started:
        yield dict(zip(specs, started))


def _flush(*servers: ServerProcess) -> None:
    for s in servers:
        assert requests.post(f"{s.base_url}/flush_cache", timeout=30).status_code == 200


def test_server_info_reports_both_members(compose_servers: dict) -> None:
    st = _state(compose_servers["snapkv+fp8_kv"])
    assert st["method"] == "snapkv+fp8_kv" and st["family"] == "eviction+quantization"
    assert st["config"]["snapkv"]["budget"] == SNAPKV["budget"]
    assert st["config"]["fp8_kv"] == {"prefix_attention": "auto"}
    # Under eviction the prefix rows are read compacted: "auto" reads their live slots dequantized.
    assert st["kv_store"]["prefix_attention"] == "dequantize" and "prefix_attention_fallback" not in st["kv_store"]
    assert st["kv_store"]["class"] == "FP8Store" and st["kv_store"]["bits"] == 8
    tq = _state(compose_servers["streamingllm+turboquant"])
    assert tq["config"]["streamingllm"]["recent_tokens"] == 128 and tq["kv_store"]["bits"] == 4
    alone = {_state(compose_servers[n])["fingerprint"] for n in ("fp8_kv", "snapkv")}
    assert st["fingerprint"] not in alone  # its own prefix-tree namespace


def test_budget_covering_context_equals_the_store_alone(compose_servers: dict) -> None:
    """Nothing evicted (prompt + output within SnapKV's budget): every token as fp8_kv alone serves it,
    single and chunked prefills (the later chunks read the quantized prefix)."""
    comp, alone = compose_servers["snapkv+fp8_kv"], compose_servers["fp8_kv"]
    before = _state(comp)["evicted_tokens_total"]
    rng = random.Random(5)
    for n in (20, 100, 200):
        ids = _ids(rng, n)
        _flush(comp, alone)
        outs = [s.generate(input_ids=ids, max_new_tokens=24, ignore_eos=True)["output_ids"] for s in (comp, alone)]
        assert outs[0] == outs[1], n
    assert _state(comp)["evicted_tokens_total"] == before
    _assert_idle_and_sound(comp)


def test_a_lossless_store_under_eviction_serves_the_eviction_methods_tokens(compose_servers: dict) -> None:
    """The compacted store path with a store that loses nothing equals SnapKV on SGLang's own pool, while
    SnapKV evicts (at the end of the prompt and every 16 decoded tokens) and on the next turn's Chain Cache hit."""
    comp, ref = compose_servers["snapkv+plain_store"], compose_servers["snapkv"]
    _flush(comp, ref)
    before = _state(comp)["evicted_tokens_total"]
    rng = random.Random(7)
    for n in (300, 700):
        history = _ids(rng, n)
        for _ in range(2):
            outs = [s.generate(input_ids=history, max_new_tokens=40, ignore_eos=True) for s in (comp, ref)]
            assert outs[0]["output_ids"] == outs[1]["output_ids"], n
            assert outs[0]["meta_info"]["cached_tokens"] == outs[1]["meta_info"]["cached_tokens"]
            history = history + outs[0]["output_ids"] + _ids(rng, 30)
    st = _assert_idle_and_sound(comp)
    assert st["evicted_tokens_total"] > before and st["chain_hits_total"] >= 2


def test_a_requests_own_prune_reaches_the_eviction_member(compose_servers: dict) -> None:
    """custom_params sgl_sparse_prune on a composition: the ranges leave before SnapKV scores the keys left through
    the store; over a store that loses nothing it serves SnapKV's own tokens with the same prune, this turn and the
    next (a hit), and the ranges stay hidden."""
    comp, ref = compose_servers["snapkv+plain_store"], compose_servers["snapkv"]
    _flush(comp, ref)
    rng = random.Random(11)
    history = _ids(rng, 600)
    ranges = [[50, 250], [400, 450]]
    cp = {"sgl_sparse_prune": json.dumps({"ranges": ranges})}
    for turn in range(2):
        extra = {"custom_params": cp} if turn == 0 else {}
        outs = [s.generate(input_ids=history, max_new_tokens=40, ignore_eos=True, **extra) for s in (comp, ref)]
        assert outs[0]["output_ids"] == outs[1]["output_ids"], turn
        assert outs[0]["meta_info"]["cached_tokens"] == outs[1]["meta_info"]["cached_tokens"]
        history = history + outs[0]["output_ids"]
        inspect = requests.post(f"{comp.base_url}/v1/prefix_cache/inspect", json={"token_ids": history},
                                timeout=60).json()
        hidden = {p for lo, hi in inspect["hidden_ranges"] for p in range(lo, hi)}
        assert {p for lo, hi in ranges for p in range(lo, hi)} <= hidden, (turn, inspect["hidden_ranges"])
        history = history + _ids(rng, 30)
    assert outs[0]["meta_info"]["cached_tokens"] > 600
    _assert_idle_and_sound(comp)


def test_a_small_budget_holds_fewer_slots_than_logical_tokens(compose_servers: dict) -> None:
    """SnapKV 256 (re-selected every 16 decoded tokens) over FP8; StreamingLLM 16 + 128 over 4-bit TurboQuant:
    the finished request leaves about the budget in the pool, of 600 and 2,300 logical tokens."""
    cases = [("snapkv+fp8_kv", 500, 100, SNAPKV["budget"], SNAPKV["budget"] + SNAPKV["decode_interval"]),
             ("streamingllm+turboquant", 2000, 300, STREAMING["sink_tokens"] + STREAMING["recent_tokens"],
              STREAMING["sink_tokens"] + STREAMING["recent_tokens"] + STREAMING["evict_interval"])]
    for name, n_prompt, n_out, low, high in cases:
        server = compose_servers[name]
        _flush(server)
        before = _assert_idle_and_sound(server)
        out = server.generate(input_ids=_ids(random.Random(1), n_prompt), max_new_tokens=n_out, ignore_eos=True)
        assert out["meta_info"]["completion_tokens"] == n_out
        after = _assert_idle_and_sound(server)
        used = after["kv_slots_used"] - before["kv_slots_used"]
        assert low <= used <= high < n_prompt + n_out, (name, used)
        assert after["evicted_tokens_total"] - before["evicted_tokens_total"] >= n_prompt + n_out - 1 - used
        assert after["decode_count_mismatches"] == 0


def test_chain_cache_resumes_from_the_compacted_quantized_kv(compose_servers: dict) -> None:
    """Three turns: each next turn matches the whole previous sequence and prefills only its new 40 tokens,
    reading the previous turn's kept FP8 slots through the compacted prefix."""
    chain_cache_three_turns(compose_servers["snapkv+fp8_kv"], SNAPKV["budget"] + SNAPKV["decode_interval"])


def test_concurrent_sessions_do_not_leak(compose_servers: dict) -> None:
    """24 random sessions of 1-3 turns, 6 at a time: decode batches of compacted rows of different lengths."""
    server = compose_servers["snapkv+fp8_kv"]

    def run(seed: int) -> int:
        local = random.Random(seed)
        history = _ids(local, local.randrange(10, 700))
        for _ in range(local.randrange(1, 4)):
            n_out = local.randrange(1, 30)
            out = server.generate(input_ids=history, max_new_tokens=n_out, ignore_eos=True)
            assert out["meta_info"]["completion_tokens"] == n_out
            history = history + out["output_ids"] + _ids(local, local.randrange(1, 60))
        return 1

    with ThreadPoolExecutor(6) as pool:
        assert sum(pool.map(run, range(24))) == 24
    st = _assert_idle_and_sound(server)
    assert st["evicted_tokens_total"] > 0 and st["decode_count_mismatches"] == 0


@pytest.mark.parametrize("name", ["snapkv+fp8_kv", "streamingllm+turboquant"])
def test_aborts_do_not_leak(compose_servers: dict, name: str) -> None:
    abort_mid_prefill_and_mid_decode(compose_servers[name], random.Random(6), name)


def test_small_model_answers_the_suite_evicting_into_4_bits(server_pool: ServerPool,
                                                            small_suite: tuple[str, list]) -> None:
    """The small trained model on the suite's short slice (every task, 4 examples, 1,024 tokens; the agent task
    as a multi-turn Chain Cache session) under SnapKV 512 over 4-bit TurboQuant: half of each prompt's KV is
    evicted, the rest is held in 4 bits, and it still answers (SnapKV 512 alone 1.00 and TurboQuant-4 alone 0.98
    at 50 examples, QUALITY.md)."""
    from sgl_sparse.quality.eval import evaluate

    model, items = small_suite
    config = {"snapkv": {"budget": 512}, "turboquant": {"bits": 4}}
    with server_pool.use(spec(model, [*CPU_SERVER_FLAGS, "--sparse-method", "snapkv+turboquant",
                                      "--sparse-config", json.dumps(config)]), once=True) as (srv,):
        table = evaluate(srv.base_url, items)
        st = _assert_idle_and_sound(srv)
    assert st["evicted_tokens_total"] > 0 and st["kv_store"]["bits"] == 4
    acc = sum(r["correct"] for r in table.values()) / sum(r["n"] for r in table.values())
    assert acc >= 0.9, table
