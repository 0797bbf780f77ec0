"""Per-request methods (custom_params sgl_sparse_method / sgl_sparse_config) through real SGLang servers on CPU
(our launcher, tiny model): a dense server that lets requests choose (--sparse-request-methods eviction), a SnapKV
server (whose requests may choose dense), and the session's dense server (per-request choice off) as the reference.

Each request must get exactly what a server of its method gives it, token for token, whatever runs beside it: dense
and SnapKV requests interleaved on one server equal the dense and SnapKV servers; their KV never mixes in the tree
(separate namespaces); Chain Cache works per request; bad choices get HTTP 400 naming the key and change nothing.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, spec
from tests.test_eviction_e2e import _assert_idle_and_sound, _flush, _ids, _state, written

pytestmark = pytest.mark.server

FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--enable-cache-report"]
BUDGET = 96
SNAPKV_CONFIG = {"budget": BUDGET, "window_size": 16, "sink_tokens": 8}
SNAPKV = {"sgl_sparse_method": "snapkv", "sgl_sparse_config": json.dumps(SNAPKV_CONFIG)}
DENSE = {"sgl_sparse_method": "dense"}


@pytest.fixture(scope="module")
def rm_servers(tiny_model: str, servers: dict[str, ServerProcess], mixed_server: ServerProcess,
               server_pool: ServerPool) -> Iterator[dict[str, ServerProcess]]:
    with server_pool.use(spec(tiny_model, [*FLAGS, "--sparse-method", "snapkv", "--sparse-config",
                                           json.dumps(SNAPKV_CONFIG)]), once=True) as (snapkv,):
        yield {"mixed": mixed_server, "snapkv": snapkv, "dense": servers["ours"]}


def _gen(server: ServerProcess, ids: list[int], n: int, custom: dict[str, Any] | None = None) -> dict:
    extra = {"custom_params": custom} if custom is not None else {}
    return server.generate(input_ids=ids, max_new_tokens=n, ignore_eos=True, **extra)


def test_server_info_reports_the_policy(rm_servers: dict) -> None:
    assert _state(rm_servers["mixed"])["request_methods"] == "eviction"
    assert _state(rm_servers["snapkv"])["request_methods"] == "eviction"  # an eviction server's default
    assert _state(rm_servers["dense"])["request_methods"] == "off"


def test_interleaved_requests_each_equal_their_own_methods_server(rm_servers: dict) -> None:
    """Dense and SnapKV requests at once on one server: each gets its method's server's tokens; the prompts
    exceed the budget, so SnapKV evicts (and its tokens differ from dense's on some prompt)."""
    mixed, snapkv, dense = rm_servers["mixed"], rm_servers["snapkv"], rm_servers["dense"]
    before = _flush(mixed)
    rng = random.Random(11)
    prompts = [_ids(rng, n) for n in (150, 300, 420, 260)]
    want_dense = [_gen(dense, p, 40)["output_ids"] for p in prompts]
    want_snapkv = [_gen(snapkv, p, 40)["output_ids"] for p in prompts]
    jobs = [(p, c) for p in prompts for c in (SNAPKV, None)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: _gen(mixed, job[0], 40, job[1]), jobs))
    for i in range(len(prompts)):
        got_snapkv, got_dense = outs[2 * i], outs[2 * i + 1]
        assert got_snapkv["output_ids"] == want_snapkv[i], i
        assert got_dense["output_ids"] == want_dense[i], i
        assert got_snapkv["meta_info"]["sgl_sparse"]["method"] == "snapkv"
        assert got_snapkv["meta_info"]["sgl_sparse"]["source"] == "request"
        assert got_snapkv["meta_info"]["sgl_sparse"]["config"]["budget"] == BUDGET
        assert got_dense["meta_info"]["sgl_sparse"] == {**got_dense["meta_info"]["sgl_sparse"], "method": "dense",
                                                        "source": "server"}
    assert want_snapkv != want_dense  # the budget is small enough to change some answer
    after = _assert_idle_and_sound(mixed)
    assert after["evicted_tokens_total"] - before["evicted_tokens_total"] >= sum(len(p) for p in prompts) - 4 * BUDGET


def test_dense_request_on_a_snapkv_server_equals_the_dense_server(rm_servers: dict) -> None:
    snapkv, dense = rm_servers["snapkv"], rm_servers["dense"]
    before = _flush(snapkv)
    ids = _ids(random.Random(3), 350)
    got = _gen(snapkv, ids, 30, DENSE)
    assert got["output_ids"] == _gen(dense, ids, 30)["output_ids"]
    assert got["meta_info"]["sgl_sparse"]["method"] == "dense"
    after = _assert_idle_and_sound(snapkv)
    assert after["evicted_tokens_total"] == before["evicted_tokens_total"]
    # Its KV stays in the tree, whole: 350 + 30 slots more than before (the dense namespace).
    assert after["kv_slots_used"] - before["kv_slots_used"] == 350 + 30


def test_namespaces_keep_each_methods_kv_apart(rm_servers: dict) -> None:
    """The same prompt as SnapKV then dense: the dense request matches nothing SnapKV left (it would read a
    compacted prefix); then each matches its own namespace's entry."""
    mixed, dense = rm_servers["mixed"], rm_servers["dense"]
    _flush(mixed)
    ids = _ids(random.Random(21), 300)
    first = _gen(mixed, ids, 10, SNAPKV)
    as_dense = _gen(mixed, ids, 10)
    assert as_dense["meta_info"]["cached_tokens"] == 0
    assert as_dense["output_ids"] == _gen(dense, ids, 10)["output_ids"]
    again_dense = _gen(mixed, ids, 10, DENSE)  # naming the server's own method: the same namespace
    assert again_dense["meta_info"]["cached_tokens"] == len(ids) - 1  # all but the token it must compute
    again_snapkv = _gen(mixed, ids, 10, SNAPKV)
    assert again_snapkv["output_ids"] == first["output_ids"]
    _assert_idle_and_sound(mixed)


def test_chain_cache_per_request(rm_servers: dict) -> None:
    """A SnapKV conversation on the dense server: every later turn caches the whole previous sequence, its KV
    stays about the budget, and its tokens equal the SnapKV server's conversation."""
    mixed, snapkv = rm_servers["mixed"], rm_servers["snapkv"]
    base = _flush(mixed)
    _flush(snapkv)
    rng = random.Random(5)
    history, prev_len = _ids(rng, 400), None
    for turn in range(3):
        out = _gen(mixed, history, 16, SNAPKV)
        ref = _gen(snapkv, history, 16)
        assert out["output_ids"] == ref["output_ids"], turn
        if prev_len is not None:
            assert out["meta_info"]["cached_tokens"] == prev_len == ref["meta_info"]["cached_tokens"], turn
        st = _assert_idle_and_sound(mixed)
        assert st["kv_slots_used"] - base["kv_slots_used"] <= BUDGET + 16 + 40, (turn, st)
        prev_len = written(len(history), out["output_ids"])
        history = history + out["output_ids"] + _ids(rng, 40)
    assert _state(mixed)["chain_hits_total"] - base["chain_hits_total"] == 2


CHAT = [{"role": "user", "content": "hello there"}]
BAD: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"sgl_sparse_method": "nope"}, ("custom_params['sgl_sparse_method']", "unknown sparse method 'nope'")),
    ({"sgl_sparse_method": "quest"}, ("sgl_sparse_method", "selection method", "--sparse-method quest")),
    ({"sgl_sparse_method": "fp8_kv"}, ("sgl_sparse_method", "KV pool's layout")),
    ({"sgl_sparse_method": "snapkv+fp8_kv"}, ("sgl_sparse_method", "composition")),
    ({"sgl_sparse_method": 3}, ("sgl_sparse_method", "must be a method name")),
    ({"sgl_sparse_method": "snapkv", "sgl_sparse_config": "{budget: 1}"}, ("sgl_sparse_config", "invalid JSON")),
    ({"sgl_sparse_method": "snapkv", "sgl_sparse_config": "[1]"}, ("sgl_sparse_config", "JSON object")),
    ({"sgl_sparse_method": "snapkv", "sgl_sparse_config": '{"budgt": 1}'}, ("sgl_sparse_config", "'budgt'")),
    ({"sgl_sparse_method": "snapkv", "sgl_sparse_config": '{"budget": "x"}'}, ("sgl_sparse_config", "'budget'")),
    ({"sgl_sparse_method": "snapkv", "sgl_sparse_config": "/etc/passwd"}, ("sgl_sparse_config", "invalid JSON")),
    ({"sgl_sparse_config": '{"budget": -5}'}, ("sgl_sparse_config",)),  # the server's method (dense): no field
]


def test_bad_choices_get_400_naming_the_key_and_change_nothing(rm_servers: dict) -> None:
    mixed, dense = rm_servers["mixed"], rm_servers["dense"]
    ids = _ids(random.Random(8), 40)
    good = _gen(mixed, ids, 8)["output_ids"]
    kv = _assert_idle_and_sound(mixed)["kv_slots_used"]
    failures = []
    for custom, needles in BAD:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "custom_params": custom}}
        r = requests.post(f"{mixed.base_url}/generate", json=body, timeout=60)
        if r.status_code != 400 or not all(n in r.text for n in needles):
            failures.append(f"{custom} -> {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    # The OpenAI routes (extra_body lands in custom_params), and a server that takes no per-request choice.
    client = openai.OpenAI(base_url=f"{mixed.base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="selection method"):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
                                       extra_body={"custom_params": {"sgl_sparse_method": "quest"}})
    off = requests.post(f"{dense.base_url}/generate", timeout=60, json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "custom_params": SNAPKV}})
    assert off.status_code == 400 and "--sparse-request-methods eviction" in off.text, off.text
    assert _gen(mixed, ids, 8)["output_ids"] == good
    assert _assert_idle_and_sound(mixed)["kv_slots_used"] == kv


def test_openai_extra_body_chooses_the_method(rm_servers: dict) -> None:
    """The OpenAI client's extra_body reaches the scheduler: a SnapKV chat on the dense server answers as the
    SnapKV server does, and the response's ``metadata`` names the method that served it (chat and completions)."""
    mixed, snapkv = rm_servers["mixed"], rm_servers["snapkv"]
    messages = [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}]
    outs = {}
    for name, server, extra in (("mixed", mixed, {"custom_params": SNAPKV}), ("snapkv", snapkv, {})):
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,  # type: ignore[arg-type]
                                           extra_body={"ignore_eos": True, **extra})
        outs[name] = r.choices[0].message.content
        served = r.to_dict()["metadata"]["sgl_sparse"]
        assert served["method"] == "snapkv" and served["source"] == ("request" if extra else "server"), served
    assert outs["mixed"] == outs["snapkv"]
    client = openai.OpenAI(base_url=f"{mixed.base_url}/v1", api_key="none", max_retries=0)
    c = client.completions.create(model="tiny", prompt="word1 word2 word3", max_tokens=4, temperature=0,
                                  extra_body={"custom_params": SNAPKV})
    meta = c.to_dict()["metadata"]
    assert meta["sgl_sparse"]["method"] == "snapkv" and "weight_version" in meta, meta
    _assert_idle_and_sound(mixed)


def test_random_mixed_sessions_do_not_leak(rm_servers: dict) -> None:
    mixed = rm_servers["mixed"]
    rng = random.Random(17)
    choices = [None, SNAPKV, DENSE, {"sgl_sparse_method": "streamingllm", "sgl_sparse_config":
                                     json.dumps({"sink_tokens": 4, "recent_tokens": 60, "evict_interval": 8})}]
    sessions = [(_ids(rng, rng.randrange(10, 500)), rng.choice(choices), rng.randrange(1, 4), rng.randrange(1, 30))
                for _ in range(10)]

    def run(session: tuple[list[int], Any, int, int]) -> int:
        history, custom, turns, n_out = session
        local = random.Random(len(history))
        for _ in range(turns):
            out = _gen(mixed, history, n_out, custom)
            assert out["meta_info"]["completion_tokens"] == n_out
            history = history + out["output_ids"] + [local.randrange(8, 2048) for _ in range(local.randrange(1, 60))]
        return turns

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(run, sessions)) >= 10
    st = _assert_idle_and_sound(mixed)
    assert st["requests_by_method"] == {}


def test_frontend_language_program_chooses_the_method(rm_servers: dict) -> None:
    """``sgl.gen`` through SparseEndpoint: the program's requests are SnapKV's on the dense server, token for
    token the SnapKV server's."""
    import sglang as sgl
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    from sgl_sparse.frontend import SparseEndpoint

    @sgl.function
    def program(s, text):  # type: ignore[no-untyped-def]
        s += text
        s += sgl.gen("answer", max_tokens=20, temperature=0, ignore_eos=True)

    text = " ".join(f"item{i}" for i in range(150))
    mixed, snapkv = rm_servers["mixed"], rm_servers["snapkv"]
    before = _flush(mixed)
    ours = program.run(text=text, backend=SparseEndpoint(mixed.base_url, method="snapkv", config=SNAPKV_CONFIG))
    ref = program.run(text=text, backend=RuntimeEndpoint(snapkv.base_url))
    assert ours["answer"] == ref["answer"]
    assert ours.get_meta_info("answer")["sgl_sparse"]["method"] == "snapkv"
    assert _assert_idle_and_sound(mixed)["evicted_tokens_total"] > before["evicted_tokens_total"]
