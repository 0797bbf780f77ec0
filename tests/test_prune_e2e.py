"""Prefix-Cache Pruning through a real SGLang server on CPU (our launcher, tiny model; the session's dense server
whose requests may choose eviction methods, and the session's plain dense server): a pruned range's KV goes back to
the pool while the conversation's next turn still matches its whole prefix; another conversation that shares the
prefix never reads a hole; a range a running request holds is blocked; hostile bodies get 400 naming the field and
change nothing; SGLang's strict leak check holds after each step.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import pytest
import requests

from sgl_sparse.server_process import ServerProcess
from tests.test_eviction_e2e import _assert_idle_and_sound, _flush, _ids, _state

pytestmark = pytest.mark.server


def _post(server: ServerProcess, path: str, body: Any) -> requests.Response:
    return requests.post(f"{server.base_url}/v1/prefix_cache/{path}", json=body, timeout=60)


def _turn(server: ServerProcess, ids: list[int], n: int) -> dict:
    return server.generate(input_ids=ids, max_new_tokens=n, ignore_eos=True)


def test_prune_frees_the_range_and_the_next_turn_still_matches(mixed_server: ServerProcess,
                                                               servers: dict[str, ServerProcess]) -> None:
    server, dense = mixed_server, servers["ours"]
    base = _flush(server)
    rng = random.Random(31)
    prompt = _ids(rng, 400)
    out = _turn(server, prompt, 20)
    seq = prompt + out["output_ids"]
    used = _assert_idle_and_sound(server)["kv_slots_used"] - base["kv_slots_used"]
    m = _post(server, "match", {"token_ids": seq}).json()
    assert m["matched_tokens"] == m["resident_tokens"] == used, (m, used)

    r = _post(server, "prune", {"token_ids": seq, "ranges": [[100, 250], [300, 350]]})
    assert r.status_code == 202, r.text
    res = r.json()
    assert res["status"] == "completed" and res["pruned_tokens"] == 200 and res["freed_slots"] == 200, res
    assert requests.get(f"{server.base_url}/v1/prefix_cache/prune/{res['prune_id']}", timeout=30).json() == res
    after = _assert_idle_and_sound(server)
    assert after["kv_slots_used"] - base["kv_slots_used"] == used - 200
    m = _post(server, "match", {"token_ids": seq}).json()
    assert m["matched_tokens"] == used and m["resident_tokens"] == used - 200 and m["hidden_tokens"] == 200, m

    # The next turn: its whole prefix is a hit (logical), its attention reads the 200 fewer, and it keeps hiding
    # them when it finishes (a record at its own end), so the turn after it matches through it too.
    history = seq + _ids(rng, 30)
    nxt = _turn(server, history, 10)
    assert nxt["meta_info"]["cached_tokens"] == used, nxt["meta_info"]
    seq2 = history + nxt["output_ids"]
    m2 = _post(server, "match", {"token_ids": seq2}).json()
    assert m2["hidden_tokens"] == 200 and m2["matched_tokens"] >= len(seq2) - 1, m2
    third = _turn(server, seq2 + _ids(rng, 5), 4)
    assert third["meta_info"]["cached_tokens"] == m2["matched_tokens"]

    # Another conversation sharing the first 350 tokens is not a continuation: its match stops at the first pruned
    # position and it recomputes from there, answering exactly as the dense server does (no hole, no pruned KV).
    other = prompt[:350] + _ids(rng, 60)
    got = _turn(server, other, 16)
    assert got["meta_info"]["cached_tokens"] == 100
    assert got["output_ids"] == _turn(dense, other, 16)["output_ids"]
    _assert_idle_and_sound(server)


def _reference_knorm(tiny_model: str, ids: list[int]) -> list[float]:
    """The knorm score of every position of ``ids``, computed apart from the server: transformers' Llama forward of
    the same weights (float32), each layer's keys ``k_proj(input_layernorm(h))`` (RoPE keeps their length), minus
    their length summed over layers and KV heads."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        total = torch.zeros(len(ids), dtype=torch.float64)
        for layer, h in zip(model.model.layers, hidden):
            k = layer.self_attn.k_proj(layer.input_layernorm(h))[0]
            k = k.view(len(ids), model.config.num_key_value_heads, -1)
            total -= k.norm(dim=-1).double().sum(dim=-1)
    return total.tolist()


def test_scored_keep_keeps_the_highest_knorm_tokens(mixed_server: ServerProcess, tiny_model: str) -> None:
    """keep_tokens > 0: of the ranges' 160 tokens the 40 of highest knorm score (lowest key norm, summed over layers
    and heads) keep their KV, the other 120 slots go back to the pool; the kept ones are the ones a reference
    forward pass outside the server ranks highest; the next turn is still a cache hit of the whole prefix."""
    from sgl_sparse.frontend import PruneRequestError, prune

    server = mixed_server
    base = _flush(server)
    rng = random.Random(81)
    prompt = _ids(rng, 400)
    seq = prompt + _turn(server, prompt, 12)["output_ids"]
    used = _assert_idle_and_sound(server)["kv_slots_used"] - base["kv_slots_used"]
    ranges = [[50, 150], [200, 260]]
    res = prune(server.base_url, token_ids=seq, ranges=ranges, keep_tokens=40)
    assert res["status"] == "completed", res
    assert (res["pruned_tokens"], res["kept_tokens"], res["freed_slots"]) == (160, 40, 120), res
    assert res["resident_tokens"] == used - 120, res
    after = _assert_idle_and_sound(server)
    assert after["kv_slots_used"] - base["kv_slots_used"] == used - 120

    insp = _post(server, "inspect", {"token_ids": seq}).json()
    assert insp["matched_tokens"] == used and insp["hidden_tokens"] == 120, insp
    hidden = {p for lo, hi in insp["hidden_ranges"] for p in range(lo, hi)}
    cand = [p for lo, hi in ranges for p in range(lo, hi)]
    assert hidden <= set(cand)
    kept = sorted(set(cand) - hidden)
    score = _reference_knorm(tiny_model, seq[:used])
    ref = sorted(sorted(cand, key=lambda p: (-score[p], p))[:40])
    # The server's keys (SGLang's CPU forward) and the reference's agree to float32 rounding, far below the gap
    # between the 40th and 41st score here, so the sets must be equal.
    ordered = sorted((score[p] for p in cand), reverse=True)
    assert ordered[39] - ordered[40] > 1e-4, ordered[38:42]
    assert kept == ref, (kept, ref)
    assert kept != cand[:40] and kept != cand[-40:]  # the score chose, not the positions

    # The next turn matches the whole prefix (the 120 hidden positions included, as holes) and keeps hiding them.
    nxt = _turn(server, seq + _ids(rng, 20), 6)
    assert nxt["meta_info"]["cached_tokens"] == used, nxt["meta_info"]
    _assert_idle_and_sound(server)
    # Bodies the server refuses name keep_tokens (no change), and policy for one it does not serve.
    for kwargs, field in (({"keep_tokens": 160}, "keep_tokens"), ({"keep_tokens": 5, "policy": "drop"}, "keep_tokens"),
                          ({"keep_tokens": 5, "policy": "h2o"}, "policy")):
        with pytest.raises(PruneRequestError) as e:
            prune(server.base_url, token_ids=seq, ranges=ranges, **kwargs)
        assert e.value.status == 400 and e.value.param == field, (kwargs, e.value)
    _assert_idle_and_sound(server)


def test_pruning_changes_what_the_continuation_attends_to(mixed_server: ServerProcess) -> None:
    """Dropping most of a long prompt changes the greedy continuation, and a second prune of the same sequence
    only adds to the hidden set (never resurrects KV)."""
    server = mixed_server
    _flush(server)
    rng = random.Random(41)
    prompt = _ids(rng, 500)
    first = _turn(server, prompt, 8)
    seq = prompt + first["output_ids"]
    tail = _ids(rng, 20)
    unpruned = _turn(server, seq + tail, 24)["output_ids"]
    _flush(server)
    again = _turn(server, prompt, 8)
    assert again["output_ids"] == first["output_ids"]
    assert _post(server, "prune", {"token_ids": seq, "ranges": [[4, 480]]}).json()["status"] == "completed"
    pruned = _turn(server, seq + tail, 24)["output_ids"]
    assert pruned != unpruned
    res = _post(server, "prune", {"token_ids": seq, "ranges": [[0, 10]]}).json()
    assert res["status"] == "completed" and res["pruned_tokens"] == 4, res  # 4..10 were hidden already
    _assert_idle_and_sound(server)


def test_a_range_a_running_request_holds_is_blocked(mixed_server: ServerProcess) -> None:
    server = mixed_server
    _flush(server)
    rng = random.Random(51)
    seq = _ids(rng, 300)
    seq += _turn(server, seq, 5)["output_ids"]
    # Long enough to be running when the prune arrives (it is sent as soon as the request is tracked).
    long_turn = threading.Thread(target=_turn, args=(server, seq + _ids(rng, 10), 600))
    long_turn.start()
    deadline = time.monotonic() + 60
    while _state(server)["requests_tracked"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = _post(server, "prune", {"token_ids": seq, "ranges": [[10, 200]]}).json()
    long_turn.join()
    assert r["status"] == "blocked" and "running request" in r["message"], r
    m = _post(server, "match", {"token_ids": seq}).json()
    assert m["hidden_tokens"] == 0  # nothing was done
    after = _post(server, "prune", {"token_ids": seq, "ranges": [[10, 200]]}).json()
    assert after["status"] == "completed" and after["pruned_tokens"] == 190, after
    _assert_idle_and_sound(server)


def test_chat_selector_prunes_old_tool_results(mixed_server: ServerProcess) -> None:
    """An agent's chat: prune the tool results but the last one (roles + lag); the next turn (the same messages
    and a new one, through the OpenAI route) is still a hit for the whole rendered history."""
    server = mixed_server
    _flush(server)
    messages: list[dict[str, str]] = [{"role": "user", "content": "look at the logs"}]
    for i in range(3):
        messages += [{"role": "assistant", "content": f"reading part {i}"},
                     {"role": "tool", "content": " ".join(f"line{i}x{j}" for j in range(60))}]
    # Serve the history once (the prompt enters the tree when the request finishes).
    body = {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}
    assert requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).status_code == 200
    res = _post(server, "prune", {"messages": messages, "roles": ["tool"], "lag": 1}).json()
    assert res["status"] == "completed" and len(res["ranges"]) == 2, res
    assert res["pruned_tokens"] == sum(hi - lo for lo, hi in res["ranges"]) and res["freed_slots"] > 0
    nxt = {**body, "messages": [*messages, {"role": "user", "content": "summarize"}]}
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=nxt, timeout=120).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= res["matched_tokens"] - 1, r["usage"]
    _assert_idle_and_sound(server)


@pytest.mark.parametrize("method,evict", [("dense", True), ("dense", False), ("snapkv", True)])
def test_an_agent_pruning_after_every_turn_keeps_each_turn_a_hit(mixed_server: ServerProcess, tiny_model: str,
                                                                 method: str, evict: bool) -> None:
    """bench_agent's pruning mode in small: after every turn the agent prunes the tool results but the last one,
    selecting the turn it just sent by its messages (rendered without the generation prompt, a few tokens short
    of the cached prompt). Each prune must find the whole history (the finished turn's record resumes from
    before its generation prompt), and the next turn must resume from there. Before the record's resume point
    backed off over the generation prompt, the second prune's selector stopped at the first prune's record:
    the prune landed there (or failed, once its ranges passed it) and every later turn recomputed the history
    after it (an agent replay on CPU: 16 of 41 prunes failed, 40 of 41 under SnapKV). And every later turn keeps the
    pruned ranges hidden: without ``evict_branches`` the ranges' KV stays for the stale reply branches, and the turn's
    own record below the prune (its reply) still looked whole, so the next turn resumed from it and read them again
    (a review's repro; the prune now voids that record)."""
    from transformers import AutoTokenizer

    server = mixed_server
    _flush(server)
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def render(msgs: list) -> list[int]:
        ids = tok.apply_chat_template(list(msgs), tokenize=True, add_generation_prompt=False)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # A SnapKV request's conversation lives in its config's namespace, which the prune names the same way.
    ns = {} if method == "dense" else {"sgl_sparse_method": "snapkv",
                                       "sgl_sparse_config": json.dumps({"budget": 256, "sink_tokens": 8})}
    extra = {"custom_params": ns} if ns else {}
    rng = random.Random(3)
    messages: list[dict[str, str]] = [{"role": "system", "content": "you are an agent " * 40},
                                      {"role": "user", "content": "fix the failing test"}]
    hidden = previous = 0
    for turn in range(6):
        body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
        r = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).json()
        if turn:  # resumes from the previous prune's record: the whole history that prune was given
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= previous, (turn, r["usage"], previous)
        if method == "dense":  # what earlier prunes hid stays hidden in this turn's cached history
            assert _post(server, "match", {"messages": messages}).json()["hidden_tokens"] >= hidden, (turn, hidden)
        if sum(m["role"] == "tool" for m in messages) > 1:
            res = _post(server, "prune", {"messages": messages, "roles": ["tool"], "lag": 1,
                                          "evict_branches": evict, **ns}).json()
            assert res["status"] == "completed" and res["matched_tokens"] == len(render(messages)), (turn, res)
            assert res["pruned_tokens"] > 0 or method == "snapkv", (turn, res)
            hidden += res["pruned_tokens"] - res["kept_tokens"]
            previous = res["matched_tokens"]
        else:
            previous = len(render(messages))  # no record yet: the cached prompt, less its generation prompt
        messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                     {"role": "tool", "content": " ".join(f"out{turn}x{rng.randrange(10**4)}" for _ in range(40))}]
    assert hidden > 0
    _assert_idle_and_sound(server)


def test_an_agents_own_prunes_with_evict_branches_free_the_pruned_kv(mixed_server: ServerProcess) -> None:
    """bench_agent's in-request pruning (``snapkv_global``, a quarter kept): each turn prunes the tool results but the
    last two inside its own request. Each earlier reply as generated (``ignore_eos``) is a branch beside the history
    the template re-renders, so copy-on-write keeps the pruned KV resident for those stale branches: without
    ``evict_branches`` the pool holds ~1,400 slots more than the conversation reads after six turns; with it, only
    the last reply's tail (measured: 10 slots)."""
    server = mixed_server
    rng = random.Random(5)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    held = {}
    for evict in (False, True):
        _flush(server)
        messages = [{"role": "system", "content": " ".join(rng.choice(words) for _ in range(300))},
                    {"role": "user", "content": "fix the failing test"}]
        for _ in range(7):
            body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0,
                                    "ignore_eos": True}
            if sum(m["role"] == "tool" for m in messages) > 2:
                body["custom_params"] = {"sgl_sparse_prune": json.dumps(
                    {"roles": ["tool"], "lag": 2, "keep_ratio": 0.25, "policy": "snapkv_global",
                     "evict_branches": evict})}
            r = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).json()
            if "custom_params" in body:
                assert r["metadata"]["sgl_sparse"]["prune"]["status"] == "applied", r.get("metadata")
            messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                         {"role": "tool", "content": " ".join(rng.choice(words) for _ in range(200))}]
        m = _post(server, "match", {"messages": messages[:-2]}).json()
        assert m["hidden_tokens"] > 1000, m
        held[evict] = _state(server)["kv_slots_used"] - m["resident_tokens"]
        _assert_idle_and_sound(server)
    assert held[True] <= 16 and held[False] > 500, held


HOSTILE: list[tuple[str, Any, str]] = [
    ("prune", {}, "token_ids"),
    ("prune", {"token_ids": [5, 6], "text": "x", "ranges": [[0, 1]]}, "token_ids"),
    ("prune", {"token_ids": [5, 6, 7]}, "ranges"),
    ("prune", {"token_ids": [5, 6, 7], "ranges": [[2, 9]]}, "ranges[0]"),
    ("prune", {"token_ids": [5, 6, 7], "ranges": [[0, 1]], "keep_tokens": 1}, "keep_tokens"),
    ("prune", {"token_ids": [5, 6, 7], "ranges": [[0, 1]], "policy": "h2o"}, "policy"),
    ("prune", {"token_ids": [5, 6, 7], "ranges": [[0, 3]], "keep_tokens": 2, "policy": "drop"}, "keep_tokens"),
    ("prune", {"token_ids": [5, 99999], "ranges": [[0, 1]]}, "token_ids[1]"),
    ("prune", {"token_ids": [5, 6], "ranges": [[0, 1]], "sgl_sparse_method": "quest"}, "sgl_sparse_method"),
    ("prune", {"token_ids": [5, 6], "roles": ["tool"]}, "roles"),
    ("prune", [1, 2, 3], "body"),
    ("match", {"text": 3}, "text"),
    ("inspect", {"tokens": [1]}, "tokens"),
]


def test_hostile_bodies_get_400_naming_the_field(mixed_server: ServerProcess) -> None:
    server = mixed_server
    before = _assert_idle_and_sound(server)["kv_slots_used"]
    bad = []
    for path, body, field in HOSTILE:
        r = _post(server, path, body)
        if r.status_code != 400 or r.json().get("param") != field or field not in r.json().get("message", ""):
            bad.append(f"{path} {body} -> {r.status_code} {r.text[:200]}")
    r = requests.post(f"{server.base_url}/v1/prefix_cache/prune", data="{not json", timeout=30)
    if r.status_code != 400:
        bad.append(f"invalid JSON -> {r.status_code} {r.text[:200]}")
    assert requests.get(f"{server.base_url}/v1/prefix_cache/prune/prune-nope", timeout=30).status_code == 404
    assert not bad, "\n".join(bad)
    assert _assert_idle_and_sound(server)["kv_slots_used"] == before


def test_uncached_and_stock_servers_fail_cleanly(mixed_server: ServerProcess,
                                                 servers: dict[str, ServerProcess]) -> None:
    res = _post(mixed_server, "prune", {"token_ids": _ids(random.Random(3), 50), "ranges": [[0, 10]]}).json()
    assert res["status"] == "failed" and "serves only the first 0" in res["message"], res
    dense = servers["ours"]  # per-request methods off: stock attention lists cannot skip pruned KV
    seq = _ids(random.Random(4), 60)
    _turn(dense, seq, 2)
    res = _post(dense, "prune", {"token_ids": seq, "ranges": [[0, 10]]}).json()
    assert res["status"] == "failed" and "--sparse-request-methods eviction" in res["message"], res
    # snapkv_global runs through a request that prunes its own prompt: refused up front where none can (400 naming
    # policy); uncached, it fails as a drop does, without sending the request.
    scored = {"ranges": [[0, 10]], "keep_tokens": 4, "policy": "snapkv_global"}
    r = _post(dense, "prune", {"token_ids": seq, **scored})
    assert r.status_code == 400 and r.json()["param"] == "policy" and "stock attention lists" in r.text, r.text
    res = _post(mixed_server, "prune", {"token_ids": _ids(random.Random(3), 50), **scored}).json()
    assert res["status"] == "failed" and "serves only the first 0" in res["message"], res
    _assert_idle_and_sound(dense)
    _assert_idle_and_sound(mixed_server)


def test_frontend_helper_prunes_a_programs_prefix(mixed_server: ServerProcess) -> None:
    """sgl_sparse.frontend's prune/match: a frontend-language program run under a per-request method
    (SparseEndpoint) is cached in that method's namespace, so the endpoint's own helpers find and prune it while
    the server's namespace holds nothing; a body the server rejects raises with the field it names."""
    import sglang as sgl

    from sgl_sparse.frontend import PruneRequestError, SparseEndpoint, match, prune

    server = mixed_server
    _flush(server)

    @sgl.function
    def program(s, text):  # type: ignore[no-untyped-def]
        s += text
        s += sgl.gen("answer", max_tokens=8, temperature=0, ignore_eos=True)

    # A window covering the whole prompt: StreamingLLM evicts nothing, so every prompt position is resident.
    ep = SparseEndpoint(server.base_url, method="streamingllm", config={"sink_tokens": 16, "recent_tokens": 2000})
    state = program.run(text=" ".join(f"item{i}" for i in range(120)), backend=ep)
    text = state.text()
    assert match(server.base_url, text=text)["matched_tokens"] == 0
    before = ep.match(text=text)
    assert before["matched_tokens"] > 100 and before["hidden_tokens"] == 0, before
    res = ep.prune(text=text, ranges=[[5, 50]])
    assert res["status"] == "completed" and res["pruned_tokens"] == 45 and res["freed_slots"] == 45, res
    after = ep.match(text=text)
    assert after["hidden_tokens"] == 45 and after["matched_tokens"] == before["matched_tokens"], after
    with pytest.raises(PruneRequestError) as e:
        prune(server.base_url, text=text, ranges=[[0, 10**6]])
    assert e.value.status == 400 and e.value.param == "ranges[0]", e.value
    with pytest.raises(ValueError, match="either ranges or roles"):
        prune(ep, text=text)
    _assert_idle_and_sound(server)


def test_per_request_prune_of_its_own_prompt(mixed_server: ServerProcess,
                                             servers: dict[str, ServerProcess]) -> None:
    """custom_params sgl_sparse_prune: the request prefills its whole prompt (its first token is dense's), then
    stops attending to the ranges and frees their KV; the tree stores its sequence with them hidden, so the next
    turn is a cache hit that keeps hiding them; a server that cannot prune answers 400 naming the key (every
    method can: tests/test_request_prune_e2e.py serves the scoring ones)."""
    server, dense = mixed_server, servers["ours"]
    base = _flush(server)
    rng = random.Random(71)
    prompt = _ids(rng, 300)
    ranges = [[20, 120], [150, 200]]
    cp = {"sgl_sparse_prune": json.dumps({"ranges": ranges})}
    out = server.generate(input_ids=prompt, max_new_tokens=16, ignore_eos=True, custom_params=cp)
    ref = _turn(dense, prompt, 16)["output_ids"]
    assert out["output_ids"][0] == ref[0] and out["output_ids"] != ref  # the prompt attended them, decode did not
    seq = prompt + out["output_ids"]
    m = _post(server, "match", {"token_ids": seq}).json()
    assert m["hidden_tokens"] == 150 and m["matched_tokens"] >= len(seq) - 1, m
    used = _assert_idle_and_sound(server)["kv_slots_used"] - base["kv_slots_used"]
    assert used == m["resident_tokens"] == m["matched_tokens"] - 150, (used, m)

    nxt = _turn(server, seq + _ids(rng, 20), 6)
    assert nxt["meta_info"]["cached_tokens"] == m["matched_tokens"], nxt["meta_info"]
    assert _post(server, "match", {"token_ids": seq + nxt["output_ids"]}).json()["hidden_tokens"] >= 150
    _assert_idle_and_sound(server)

    bad = [(server, {"sgl_sparse_prune": json.dumps({"ranges": [[0, 301]]})}, "[0, 301)"),
           (dense, cp, "stock attention lists")]
    for srv, params, words in bad:
        r = requests.post(f"{srv.base_url}/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 2, "custom_params": params}}, timeout=60)
        assert r.status_code == 400 and "sgl_sparse_prune" in r.text and words in r.text, (params, r.text[:300])
    _assert_idle_and_sound(server)


def test_per_request_prune_chat_form(mixed_server: ServerProcess, tiny_model: str) -> None:
    """On /v1/chat/completions, sgl_sparse_prune may name roles + lag: the route resolves them against the request's
    own messages (the content spans POST /v1/prefix_cache/prune would pick), and the finished turn is cached with
    exactly those hidden; the next turn is a hit."""
    from transformers import AutoTokenizer

    from sgl_sparse.prune.body import message_spans, role_ranges

    server = mixed_server
    _flush(server)
    messages: list[dict[str, str]] = [{"role": "user", "content": "read the logs"}]
    for i in range(3):
        messages += [{"role": "assistant", "content": f"reading part {i}"},
                     {"role": "tool", "content": " ".join(f"entry{i}y{j}" for j in range(50))}]
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def render(msgs: list, generation_prompt: bool = False) -> list[int]:
        ids = tok.apply_chat_template(list(msgs), tokenize=True, add_generation_prompt=generation_prompt)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    expected = sum(hi - lo for lo, hi in role_ranges(message_spans(render, messages), messages, ["tool"], 1))
    assert expected > 0
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0,
            "custom_params": {"sgl_sparse_prune": json.dumps({"roles": ["tool"], "lag": 1})}}
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text[:300]
    # The finished turn's record continues from the end of its prompt, less the generation prompt: a match of the
    # prompt, or of the history alone (as the prune route renders messages), sees the hidden ranges.
    prompt = render(messages, generation_prompt=True)
    assert prompt[:len(render(messages))] == render(messages)
    m = _post(server, "match", {"token_ids": prompt}).json()
    assert m["hidden_tokens"] == expected and m["matched_tokens"] == len(prompt), (m, expected)
    alone = _post(server, "match", {"messages": messages}).json()
    assert alone["hidden_tokens"] == expected and alone["matched_tokens"] == len(render(messages)), alone
    # The outcome in the OpenAI response's metadata, as /generate's meta_info has it.
    report = r.json()["metadata"]["sgl_sparse"]["prune"]
    assert report["status"] == "applied" and report["pruned_tokens"] == expected, report
    reply = r.json()["choices"][0]["message"]["content"]
    nxt = {**body, "messages": [*messages, {"role": "assistant", "content": reply},
                                {"role": "user", "content": "summarize"}]}
    del nxt["custom_params"]
    usage = requests.post(f"{server.base_url}/v1/chat/completions", json=nxt, timeout=120).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= m["matched_tokens"], usage
    bad = {**body, "custom_params": {"sgl_sparse_prune": json.dumps({"roles": ["tool"], "lagg": 1})}}
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and "sgl_sparse_prune" in r.text and "lagg" in r.text, r.text[:300]
    _assert_idle_and_sound(server)

    # With a scored keep (here a fraction of the ranges' union): the keep fields travel with the resolved ranges.
    _flush(server)
    keep = {**body, "custom_params": {"sgl_sparse_prune": json.dumps({"roles": ["tool"], "lag": 1,
                                                                       "keep_ratio": 0.25})}}
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=keep, timeout=120)
    assert r.status_code == 200, r.text[:300]
    m = _post(server, "match", {"token_ids": prompt}).json()
    assert m["hidden_tokens"] == expected - int(0.25 * expected), (m, expected)
    # A keep_tokens covering every token the roles select (the client cannot know how many): nothing to prune.
    _flush(server)
    covering = {**body, "custom_params": {"sgl_sparse_prune": json.dumps({"roles": ["tool"], "lag": 1,
                                                                           "keep_tokens": expected})}}
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=covering, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert _post(server, "match", {"token_ids": prompt}).json()["hidden_tokens"] == 0
    # Bad keep fields are a 400 even when the roles select nothing (lag 9 spares every tool message).
    for spec, words in (({"lag": 9, "keep_tokens": -3}, "keep_tokens: expected an integer >= 0"),
                        ({"lag": 1, "keep_ratio": 0.5, "policy": "bogus"}, "policy: 'bogus'")):
        bad = {**body, "custom_params": {"sgl_sparse_prune": json.dumps({"roles": ["tool"], **spec})}}
        r = requests.post(f"{server.base_url}/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == 400 and "sgl_sparse_prune" in r.text and words in r.text, r.text[:300]
    _assert_idle_and_sound(server)
