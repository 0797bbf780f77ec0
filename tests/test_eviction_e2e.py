"""Eviction methods and Chain Cache through real SGLang servers on CPU (our launcher, tiny model).

SGLang's strict idle leak check (``available + evictable + protected == total``, raising in the
scheduler) is on by default, so a leak kills the server: every test below ends by checking the server
is healthy, idle, and that our own numbers agree with that invariant.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import PREFIXED_TEMPLATE, ServerPool, Spec, assert_idle_and_sound, fresh, spec, state

pytestmark = pytest.mark.server

STREAMING = {"sink_tokens": 16, "recent_tokens": 128, "evict_interval": 16}
SNAPKV = {"budget": 256, "window_size": 16, "sink_tokens": 8, "kernel_size": 5, "decode_interval": 16}
FLAGS = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128"]


def streaming_spec(model: str) -> Spec:
    """StreamingLLM (sink 16, recent 128): this file's, the Chain Cache traffic tests'."""
    return spec(model, [*FLAGS, "--sparse-method", "streamingllm", "--sparse-config", json.dumps(STREAMING),
                        "--enable-metrics", "--enable-cache-report"])


def snapkv_spec(model: str, template: str) -> Spec:
    """SnapKV 256 with the prefixed chat template: this file's, the compositions' plain SnapKV."""
    return spec(model, [*FLAGS, "--sparse-method", "snapkv", "--sparse-config", json.dumps(SNAPKV),
                        "--chat-template", template, "--enable-cache-report"])


@pytest.fixture(scope="module")
def sparse_servers(tiny_model: str, servers: dict[str, ServerProcess], server_pool: ServerPool,
                   prefixed_template: str) -> Iterator[dict[str, ServerProcess]]:
    with server_pool.use(streaming_spec(tiny_model), snapkv_spec(tiny_model, prefixed_template)) as (st, sn):
        yield {"streamingllm": st, "snapkv": sn, "vanilla": servers["vanilla"], "dense": servers["ours"]}


_state = state
_assert_idle_and_sound = assert_idle_and_sound


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 2048) for _ in range(n)]


def written(prompt_len: int, output: Sequence[int]) -> int:
    """The positions a finished turn computed K/V for and leaves in the tree: its prompt and every output token
    but the last, whose K/V SGLang computes only in the forward its overlap scheduler launches after the finish,
    a forward no step of ours runs for (integration/step.py), so the tree frees it, as without overlap."""
    return prompt_len + len(output) - 1


_flush = fresh


def covering_budget_equals_dense(servers: dict, cases: Sequence[tuple[int, int]]) -> tuple[dict, dict]:
    """Random prompts of ``cases`` (prompt tokens, new tokens) on ``servers["small"]`` (a method whose budget covers
    them) and ``servers["dense"]``: the same greedy tokens, and nothing evicted. Returns the small server's state
    after a flush and after the prompts (for checks of its own)."""
    server = servers["small"]
    before = _flush(server)
    fresh(servers["dense"])  # the session's: other files sent these prompts; both compute them from scratch
    rng = random.Random(7)
    for n, out in cases:
        ids = _ids(rng, n)
        got = {name: servers[name].generate(input_ids=ids, max_new_tokens=out, ignore_eos=True)["output_ids"]
               for name in ("small", "dense")}
        assert got["small"] == got["dense"], n
    after = _assert_idle_and_sound(server)
    assert after["evicted_tokens_total"] == before["evicted_tokens_total"]
    return before, after


@pytest.mark.parametrize("method", ["streamingllm", "snapkv"])
def test_budget_covering_context_equals_dense_and_vanilla(sparse_servers: dict, method: str) -> None:
    rng = random.Random(5)
    for n in (20, 60, 100):
        ids = _ids(rng, n)
        outs = {name: sparse_servers[name].generate(input_ids=ids, max_new_tokens=24, ignore_eos=True)["output_ids"]
                for name in (method, "dense", "vanilla")}
        assert outs[method] == outs["dense"] == outs["vanilla"], n
    _assert_idle_and_sound(sparse_servers[method])


def test_streamingllm_long_prompt_keeps_about_the_budget(sparse_servers: dict) -> None:
    server = sparse_servers["streamingllm"]
    base = fresh(server)
    before = base["kv_slots_used"]
    out = server.generate(input_ids=_ids(random.Random(1), 2000), max_new_tokens=300, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 300  # generation continues past the budget
    after = _assert_idle_and_sound(server)
    budget = STREAMING["sink_tokens"] + STREAMING["recent_tokens"]
    used = after["kv_slots_used"] - before
    assert budget <= used <= budget + STREAMING["evict_interval"], used
    # written(2000, 300 tokens); a shared server: counted from this test's start
    assert after["evicted_tokens_total"] - base["evicted_tokens_total"] >= 2299 - used


@pytest.mark.parametrize(("method", "limit"), [
    ("streamingllm", STREAMING["sink_tokens"] + STREAMING["recent_tokens"] + STREAMING["evict_interval"]),
    ("snapkv", SNAPKV["budget"] + SNAPKV["decode_interval"]),  # re-selected every 16 decoded tokens
])
def test_chain_cache_three_turns(sparse_servers: dict, method: str, limit: int) -> None:
    chain_cache_three_turns(sparse_servers[method], limit)


def chain_cache_three_turns(server: ServerProcess, limit: int) -> dict:
    """Three turns of one conversation on an evicting ``server`` (700 random tokens, 20 out and 40 new a turn), the
    tree flushed first: each next turn is a Chain Cache hit on the whole previous logical sequence and prefills only
    the last answer token and its 40 new ones; after each turn the pool holds at most ``limit`` slots more than
    before. Returns the server's state before the turns."""
    base = fresh(server)
    rng = random.Random(9)
    history = _ids(rng, 700)
    prev_len = None
    for turn in range(3):
        out = server.generate(input_ids=history, max_new_tokens=20, ignore_eos=True)
        meta = out["meta_info"]
        if prev_len is not None:
            # The whole previous logical sequence matches; only the new suffix is prefilled.
            assert meta["cached_tokens"] == prev_len, (turn, meta["cached_tokens"], prev_len)
            assert meta["prompt_tokens"] - meta["cached_tokens"] == 41  # the last answer token and 40 new
        st = _assert_idle_and_sound(server)
        assert st["kv_slots_used"] - base["kv_slots_used"] <= limit, (turn, st)
        prev_len = written(len(history), out["output_ids"])
        history = history + out["output_ids"] + _ids(rng, 40)
    assert _state(server)["chain_hits_total"] - base["chain_hits_total"] == 2
    return base


def test_chain_branches_two_continuations_of_one_prefix(sparse_servers: dict) -> None:
    server = sparse_servers["snapkv"]
    rng = random.Random(3)
    prefix = _ids(rng, 600)
    first = server.generate(input_ids=prefix, max_new_tokens=10, ignore_eos=True)
    shared = prefix + first["output_ids"]
    branches = [shared + _ids(rng, 30) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda ids: server.generate(input_ids=ids, max_new_tokens=12, ignore_eos=True),
                             branches))
    for o in outs:
        assert o["meta_info"]["cached_tokens"] == written(len(prefix), first["output_ids"])
        assert o["meta_info"]["completion_tokens"] == 12
    _assert_idle_and_sound(server)


def test_next_turn_leaving_the_previous_answer_resumes_after_its_last_eviction(sparse_servers: dict) -> None:
    """An agent's next turn whose history differs inside the previous answer (re-tokenized text does
    that) still resumes from the previous turn's kept KV, cut where it leaves, once it is past that
    turn's last eviction: SnapKV here re-selects at 16 decoded tokens (decode_interval)."""
    server = sparse_servers["snapkv"]
    requests.post(f"{server.base_url}/flush_cache", timeout=30)
    base = _assert_idle_and_sound(server)
    rng = random.Random(21)
    prompt = _ids(rng, 600)
    answer = server.generate(input_ids=prompt, max_new_tokens=20, ignore_eos=True)["output_ids"]
    _assert_idle_and_sound(server)
    late = server.generate(input_ids=prompt + answer[:18] + _ids(rng, 30), max_new_tokens=4, ignore_eos=True)
    assert late["meta_info"]["cached_tokens"] == 618, late["meta_info"]
    st = _assert_idle_and_sound(server)
    assert st["chain_hits_total"] - base["chain_hits_total"] == 1
    # Left before the re-selection at 616: the kept set cut there is no state the first turn had, so
    # the match stops at the first hole (inside the prompt, after SnapKV's 8 sink tokens).
    early = server.generate(input_ids=prompt + answer[:10] + _ids(rng, 30), max_new_tokens=4, ignore_eos=True)
    assert SNAPKV["sink_tokens"] <= early["meta_info"]["cached_tokens"] < 600, early["meta_info"]
    _assert_idle_and_sound(server)


def test_chat_turns_resume_although_the_template_renders_the_answer_differently(
        sparse_servers: dict, tiny_model: str) -> None:
    """OpenAI chat through a template whose history turn differs from its generation prompt: every
    next turn matches as much as a dense prefix cache would (the two prompts' common prefix, from
    the tokenizer here), the Chain Cache resuming from before the previous generation prompt."""
    from transformers import AutoTokenizer

    server = sparse_servers["snapkv"]
    requests.post(f"{server.base_url}/flush_cache", timeout=30)
    base = _assert_idle_and_sound(server)
    assert base["chain_resume_suffix_tokens"] > 0
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def prompt_ids(messages: list[dict]) -> list[int]:
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      chat_template=PREFIXED_TEMPLATE)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    rng = random.Random(5)
    words = "the file list returns a value when the path exists and raises otherwise".split()
    messages = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(400))},
                {"role": "user", "content": "Read the file."}]
    prev = None
    for turn in range(3):
        ids = prompt_ids(messages)
        r = requests.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(ids) > SNAPKV["budget"]
        if prev is not None:
            common = next((i for i, (x, y) in enumerate(zip(prev, ids)) if x != y), len(prev))
            assert common < len(prev)  # the template's doing: the next turn leaves the prompt
            assert usage["prompt_tokens_details"]["cached_tokens"] == common, (turn, usage, common)
        prev = ids
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": " ".join(rng.choice(words) for _ in range(30))}]
        _assert_idle_and_sound(server)
    assert _state(server)["chain_hits_total"] - base["chain_hits_total"] == 2


def _abort_after(server: ServerProcess, rid: str, delay: float) -> None:
    time.sleep(delay)
    requests.post(f"{server.base_url}/abort_request", json={"rid": rid}, timeout=30)


def shared_prefix_answers_as_cold(srv: ServerProcess, rng: random.Random, system_len: int, cached: int) -> None:
    """Two conversations share a ``system_len``-token prompt: the second, after the first, matches ``cached`` tokens
    (at least) of it in the tree and gives the greedy tokens it gives cold (the tree flushed)."""
    system = _ids(rng, system_len)
    first, second = system + _ids(rng, 55), system + _ids(rng, 73)
    fresh(srv)
    srv.generate(input_ids=first, max_new_tokens=8, ignore_eos=True)
    warm = srv.generate(input_ids=second, max_new_tokens=24, ignore_eos=True)
    assert warm["meta_info"]["cached_tokens"] >= cached
    fresh(srv)
    cold = srv.generate(input_ids=second, max_new_tokens=24, ignore_eos=True)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["output_ids"] == cold["output_ids"]
    _assert_idle_and_sound(srv)


def abort_mid_prefill_and_mid_decode(server: ServerProcess, rng: random.Random, tag: str) -> None:
    """Abort one request during a 3,000-token prefill and one mid-decode; the server ends idle and sound
    after each."""
    for i, (n_prompt, n_out, delay) in enumerate([(3000, 8, 0.05), (300, 2000, 1.0)]):
        rid = f"abort-{tag}-{i}"
        t = threading.Thread(target=_abort_after, args=(server, rid, delay))
        t.start()
        body = {"rid": rid, "input_ids": _ids(rng, n_prompt),
                "sampling_params": {"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True}}
        r = requests.post(f"{server.base_url}/generate", json=body, timeout=300)
        t.join()
        assert r.status_code in (200, 400), r.text
        if r.status_code == 200:
            assert r.json()["meta_info"]["finish_reason"]["type"] == "abort", r.json()["meta_info"]
        _assert_idle_and_sound(server)


@pytest.mark.parametrize("method", ["streamingllm", "snapkv"])
def test_aborts_mid_prefill_and_mid_decode_do_not_leak(sparse_servers: dict, method: str) -> None:
    abort_mid_prefill_and_mid_decode(sparse_servers[method], random.Random(4), method)


def test_flush_cache_returns_every_slot(sparse_servers: dict) -> None:
    server = sparse_servers["streamingllm"]
    server.generate(input_ids=_ids(random.Random(8), 900), max_new_tokens=20, ignore_eos=True)
    _assert_idle_and_sound(server)
    r = requests.post(f"{server.base_url}/flush_cache", timeout=30)
    assert r.status_code == 200
    st = _state(server)
    assert st["kv_slots_used"] == 0 and st["tree_evictable_slots"] == 0
    _assert_idle_and_sound(server)


@pytest.mark.parametrize("method", ["streamingllm", "snapkv"])
def test_many_random_multi_turn_sessions_do_not_leak(sparse_servers: dict, method: str) -> None:
    """100 requests per method (200 in all): random sessions, lengths and turn counts, 6 at a time."""
    server = sparse_servers[method]
    rng = random.Random(hash(method) % 1000)
    sessions = [(_ids(rng, rng.randrange(10, 900)), rng.randrange(1, 5), rng.randrange(1, 40))
                for _ in range(40)]

    def run(session: tuple[list[int], int, int]) -> int:
        history, turns, n_out = session
        local = random.Random(len(history))
        done = 0
        for _ in range(turns):
            out = server.generate(input_ids=history, max_new_tokens=n_out, ignore_eos=True)
            assert out["meta_info"]["completion_tokens"] == n_out
            history = history + out["output_ids"] + [local.randrange(8, 2048) for _ in range(local.randrange(1, 80))]
            done += 1
        return done

    with ThreadPoolExecutor(6) as pool:
        total = sum(pool.map(run, sessions))
    assert total >= 60
    rest = 100 - total
    for _ in range(max(rest, 0)):
        server.generate(input_ids=_ids(rng, rng.randrange(5, 400)), max_new_tokens=5, ignore_eos=True)
    st = _assert_idle_and_sound(server)
    assert st["evicted_tokens_total"] > 0


def test_prometheus_metrics(sparse_servers: dict) -> None:
    server = sparse_servers["streamingllm"]
    server.generate(input_ids=_ids(random.Random(12), 400), max_new_tokens=5, ignore_eos=True)
    st = _assert_idle_and_sound(server)
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("sgl_sparse:") and 'method="streamingllm"' in line:
            name = line.split("{")[0]
            values[name] = float(line.rsplit(" ", 1)[1])
    assert values["sgl_sparse:evicted_tokens_total"] == st["evicted_tokens_total"]
    assert values["sgl_sparse:chain_hits_total"] == st["chain_hits_total"]
    assert "sgl_sparse:kv_slots_used" in values and "sgl_sparse:logical_tokens_running" in values


def test_snapkv_decode_reselection_bounds_kept_tokens(sparse_servers: dict) -> None:
    server = sparse_servers["snapkv"]
    requests.post(f"{server.base_url}/flush_cache", timeout=30)
    before = _assert_idle_and_sound(server)
    out = server.generate(input_ids=_ids(random.Random(21), 500), max_new_tokens=100, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 100
    after = _assert_idle_and_sound(server)
    used = after["kv_slots_used"] - before["kv_slots_used"]
    # 500 + 100 logical tokens; re-selection every 16 decoded tokens keeps it near the budget.
    assert SNAPKV["budget"] <= used <= SNAPKV["budget"] + SNAPKV["decode_interval"], used
    assert after["eviction_steps_total"] - before["eviction_steps_total"] >= 1 + 100 // 16 - 1


def alone_equals_beside_traffic(server: ServerProcess, rng: random.Random, n: int = 500) -> None:
    """One prompt's greedy answer alone on a flushed server, sent among four other requests (so its prefill
    chunks start and end elsewhere: SGLang shares a step's chunk budget), and again once their sequences fill the
    tree: the same tokens each time. A method's decisions must not depend on other users' traffic (KVzip's replay
    chunks once did, through the pool's free slots)."""
    prompt = _ids(rng, n)
    others = [_ids(rng, 60 + 37 * k) for k in range(4)]
    _flush(server)
    alone = server.generate(input_ids=prompt, max_new_tokens=24, ignore_eos=True)["output_ids"]
    _flush(server)
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(server.generate, input_ids=o, max_new_tokens=30, ignore_eos=True) for o in others[:2]]
        mine = pool.submit(server.generate, input_ids=prompt, max_new_tokens=24, ignore_eos=True)
        futures += [pool.submit(server.generate, input_ids=o, max_new_tokens=30, ignore_eos=True) for o in others[2:]]
        beside = mine.result()["output_ids"]
        for f in futures:
            f.result()
    after = server.generate(input_ids=prompt, max_new_tokens=24, ignore_eos=True)["output_ids"]
    assert beside == alone, "the answer changed beside other requests"
    assert after == alone, "the answer changed after other requests"
    _assert_idle_and_sound(server)


@pytest.mark.parametrize("method", ["streamingllm", "snapkv"])
def test_an_answer_alone_equals_beside_and_after_other_traffic(sparse_servers: dict, method: str) -> None:
    alone_equals_beside_traffic(sparse_servers[method], random.Random(41))


@pytest.mark.parametrize("method", ["streamingllm", "snapkv"])
def test_one_conversations_eviction_never_changes_anothers_answer(sparse_servers: dict, method: str) -> None:
    """Two conversations on one shared system prompt. B's greedy output is the same whether or not A
    ran first and evicted inside that prompt (copy-on-write Chain Cache), and A's next turn still
    resumes from A's compacted KV."""
    server = sparse_servers[method]
    rng = random.Random(31)
    system = _ids(rng, 500)
    a_turn, b_turn = system + _ids(rng, 60), system + _ids(rng, 60)
    requests.post(f"{server.base_url}/flush_cache", timeout=30)
    b_alone = server.generate(input_ids=b_turn, max_new_tokens=30, ignore_eos=True)["output_ids"]

    requests.post(f"{server.base_url}/flush_cache", timeout=30)
    base = _assert_idle_and_sound(server)
    a = server.generate(input_ids=a_turn, max_new_tokens=30, ignore_eos=True)
    after_a = _assert_idle_and_sound(server)
    assert after_a["evicted_tokens_total"] > base["evicted_tokens_total"]  # A really evicted
    b = server.generate(input_ids=b_turn, max_new_tokens=30, ignore_eos=True)
    assert b["output_ids"] == b_alone, "B's answer changed because A ran first"
    # B matched only the part of the prompt that A left whole (before A's first evicted position).
    assert b["meta_info"]["cached_tokens"] < len(system)
    # A's next turn is still a Chain Cache hit over its whole previous sequence.
    a2 = server.generate(input_ids=a_turn + a["output_ids"] + _ids(rng, 20), max_new_tokens=5, ignore_eos=True)
    assert a2["meta_info"]["cached_tokens"] == written(len(a_turn), a["output_ids"])
    st = _assert_idle_and_sound(server)
    assert st["chain_hits_total"] - after_a["chain_hits_total"] == 1
