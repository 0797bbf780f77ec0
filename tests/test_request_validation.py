"""Request validation in the HTTP process (sgl_sparse/integration/validation.py): the unit rules, then a
real CPU server started by our launcher. Each hostile body must get 400 with the field named, must not
reach the scheduler, and must leave the server serving the same greedy tokens as before."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import requests

from sgl_sparse.integration import BACKEND_NAME, validation
from sgl_sparse.integration.validation import RequestValidationError, validate_generate_input
from sgl_sparse.server_process import ServerProcess
from sgl_sparse.tiny_model import TINY_CONFIG
from tests.server_pool import assert_idle_and_sound, fresh

VOCAB = int(TINY_CONFIG["vocab_size"])  # 2048; the tiny model's config.json vocab_size == model_config.vocab_size


# -- the validation function, no server ---------------------------------------------------------

def _reject(match: str, text: Any = None, input_ids: Any = None, sampling_params: Any = None) -> str:
    with pytest.raises(RequestValidationError) as e:
        validate_generate_input(text, input_ids, sampling_params, VOCAB)
    assert match in str(e.value), str(e.value)
    return str(e.value)


def test_valid_inputs_pass() -> None:
    validate_generate_input(None, [0, 5, VOCAB - 1], {"temperature": 0}, VOCAB)
    validate_generate_input(None, [[0], [VOCAB - 1, 3]], [{}, {"custom_params": None}], VOCAB)
    validate_generate_input("hi", None, None, VOCAB)
    # SGLang's own CustomParamValue shapes: scalars, lists of scalars, flat objects of scalars.
    flat = {"a": 1, "b": "x", "c": None, "d": 0.5, "e": True, "token_ids": [1, 2], "f": {"g": 1, "h": None}}
    validate_generate_input(None, [1], {"custom_params": flat}, VOCAB)
    # What SGLang rejects itself is left to it.
    validate_generate_input(None, [], None, VOCAB)
    validate_generate_input(None, ["a", "b"], None, VOCAB)


def test_token_ids_outside_vocab() -> None:
    msg = _reject("input_ids[1] = -1", input_ids=[3, -1, 4])
    assert f"[0, {VOCAB})" in msg
    _reject(f"input_ids[2] = {VOCAB}", input_ids=[3, 4, VOCAB])
    _reject("input_ids[1][0] = -7", input_ids=[[3], [-7, 1]])
    _reject(f"input_ids[0][1] = {VOCAB + 5}", input_ids=[[3, VOCAB + 5]])


def test_text_with_input_ids() -> None:
    _reject("text and input_ids", text="hello", input_ids=[1, 2])
    _reject("text and input_ids", text=["a", "b"], input_ids=[[1], [2]])


def test_custom_params() -> None:
    _reject("custom_params['x'] is nested", sampling_params={"custom_params": {"x": {"y": {"z": 1}}}})
    _reject("custom_params['x'] is nested", sampling_params={"custom_params": {"x": [[1]]}})
    _reject("custom_params['x'] is nested", sampling_params={"custom_params": {"x": [{"y": 1}]}})
    _reject("custom_params['x'] is nested", sampling_params={"custom_params": {"x": object()}})
    msg = _reject("unknown key 'sgl_sparse_methd'", sampling_params={"custom_params": {"sgl_sparse_methd": "a"}})
    assert "known sgl_sparse_* keys: sgl_sparse_config, sgl_sparse_method" in msg
    _reject("custom_params must be a JSON object", sampling_params={"custom_params": "sgl_sparse_method=x"})
    # Batched: the item is named.
    _reject("sampling_params[1].custom_params: unknown key 'sgl_sparse_x'",
            sampling_params=[{"custom_params": {"a": 1}}, {"custom_params": {"sgl_sparse_x": 1}}])
    _reject("sampling_params[0].custom_params['k'] is nested", sampling_params=[{"custom_params": {"k": {"a": []}}}])


def test_known_keys_pass_and_are_listed() -> None:
    validate_generate_input(None, [1], {"custom_params": {"sgl_sparse_method": "snapkv"}}, VOCAB)
    msg = _reject("unknown key 'sgl_sparse_budget'", sampling_params={"custom_params": {"sgl_sparse_budget": 8}})
    assert "sgl_sparse_config, sgl_sparse_method" in msg


def test_hook_acts_only_in_servers_whose_tree_is_ours() -> None:
    from sglang.srt.managers.io_struct import EmbeddingReqInput, GenerateReqInput

    def tm(backend: str) -> SimpleNamespace:
        return SimpleNamespace(server_args=SimpleNamespace(radix_cache_backend=backend),
                               model_config=SimpleNamespace(vocab_size=VOCAB))

    bad = GenerateReqInput(input_ids=[1, -1])
    validation.before_generate_request(tm("radix"), bad, None)  # a vanilla server on the host: untouched
    validation.before_generate_request(tm(BACKEND_NAME), EmbeddingReqInput(input_ids=[1, -1]), None)
    with pytest.raises(RequestValidationError, match=r"input_ids\[1\] = -1"):
        validation.before_generate_request(tm(BACKEND_NAME), bad, None)
    with pytest.raises(RequestValidationError, match="text and input_ids"):
        validation.before_generate_request(tm(BACKEND_NAME), obj=GenerateReqInput(text="a", input_ids=[1]))


# -- a real server started by our launcher ------------------------------------------------------

GOOD_IDS = [(37 * i + 11) % 2000 + 8 for i in range(40)]
CHAT = [{"role": "user", "content": "List the files in the repository."}]


@pytest.fixture(scope="module")
def srv(server: ServerProcess) -> ServerProcess:
    """The session's dense server: a hostile request must leave a server others use as it was."""
    return server


def _good(srv: ServerProcess) -> dict[str, Any]:
    """Greedy outputs of the good requests, one per endpoint."""
    gen = srv.generate(input_ids=GOOD_IDS, max_new_tokens=12, ignore_eos=True)["output_ids"]
    # A flat custom_params (SGLang's own shapes, list values included) is served and changes nothing.
    with_cp = srv.generate(input_ids=GOOD_IDS, max_new_tokens=12, ignore_eos=True,
                           custom_params={"note": "x", "token_ids": [1, 2], "opts": {"a": 1}})["output_ids"]
    assert with_cp == gen
    comp = requests.post(f"{srv.base_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": GOOD_IDS, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    chat = requests.post(f"{srv.base_url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert comp.status_code == 200 and chat.status_code == 200, (comp.text, chat.text)
    return {"generate": gen, "completions": comp.json()["choices"][0]["text"],
            "chat": chat.json()["choices"][0]["message"]["content"]}


def _gen(ids: Any = None, **body: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"sampling_params": {"max_new_tokens": 4, **body.pop("sampling", {})}, **body}
    if ids is not None:
        out["input_ids"] = ids
    return out


def _comp(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 4, **body}


def _chat(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, "max_tokens": 4, **body}


NESTED = {"cfg": {"inner": {"x": 1}}}
UNKNOWN = {"sgl_sparse_methd": "snapkv"}
# (route, body, substrings the error message must contain). Prompts differ from GOOD_IDS, so anything
# that got served would add KV to the tree.
HOSTILE: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("/generate", _gen([5, 6, -1, 7]), ("input_ids[2] = -1", f"[0, {VOCAB})")),
    ("/generate", _gen([5, 6, 7, VOCAB]), (f"input_ids[3] = {VOCAB}", f"[0, {VOCAB})")),
    ("/generate", _gen([[5, 6], [9, 10, VOCAB]]), (f"input_ids[1][2] = {VOCAB}",)),
    ("/generate", _gen([5, 6, 7], text="and some text"), ("text and input_ids",)),  # vanilla: text ignored
    ("/generate", _gen([[5], [6]], text="hi"), ("text and input_ids",)),  # vanilla: 500
    ("/generate", _gen([5, 6, 10], sampling={"custom_params": "x"}), ("custom_params must be a JSON object",)),
    ("/generate", _gen([5, 6, 8], sampling={"custom_params": NESTED}), ("custom_params['cfg']", "nested")),
    ("/generate", _gen([5, 6, 9], sampling={"custom_params": UNKNOWN}), ("sgl_sparse_methd", "known")),
    ("/generate", {"input_ids": [[5, 1], [5, 2]],
                   "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 4, "custom_params": UNKNOWN}]},
     ("sampling_params[1].custom_params", "sgl_sparse_methd")),
    ("/v1/completions", _comp(prompt=[5, 6, -1]), ("input_ids[2] = -1", f"[0, {VOCAB})")),
    ("/v1/completions", _comp(prompt=[5, 6, 11, VOCAB]), (f"input_ids[3] = {VOCAB}",)),
    ("/v1/completions", _comp(prompt=[[5, 6], [5, -2]]), ("input_ids[1][1] = -2",)),
    ("/v1/completions", _comp(prompt=[5, 6, 12], custom_params=NESTED), ("custom_params['cfg']", "nested")),
    ("/v1/completions", _comp(prompt="hello there", custom_params=UNKNOWN), ("sgl_sparse_methd", "known")),
    ("/v1/completions", _comp(prompt=[5, 6, -1], stream=True), ("input_ids[2] = -1",)),
    ("/v1/chat/completions", _chat(input_ids=[5, -1]), ("input_ids[1] = -1", f"[0, {VOCAB})")),
    ("/v1/chat/completions", _chat(input_ids=[5, 13, VOCAB]), (f"input_ids[2] = {VOCAB}",)),
    ("/v1/chat/completions", _chat(custom_params=NESTED), ("custom_params['cfg']", "nested")),
    ("/v1/chat/completions", _chat(custom_params=UNKNOWN), ("sgl_sparse_methd", "known")),
    ("/v1/chat/completions", _chat(custom_params=UNKNOWN, stream=True), ("sgl_sparse_methd",)),
]


def _kv_used(srv: ServerProcess) -> int:
    return int(assert_idle_and_sound(srv)["kv_slots_used"])


@pytest.mark.server
def test_hostile_requests_get_400_and_change_nothing(srv: ServerProcess) -> None:
    fresh(srv)  # a shared server: an empty tree, so no other test's cache is freed to make room here
    before = _good(srv)
    kv_before = _kv_used(srv)
    failures = []
    for route, body, needles in HOSTILE:
        r = requests.post(f"{srv.base_url}{route}", json=body, timeout=60)
        if r.status_code != 400 or not all(n in r.text for n in needles):
            failures.append(f"{route} {json.dumps(body)} -> {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)

    # The OpenAI client's extra_body lands in the top-level custom_params field.
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="sgl_sparse_methd"):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
                                       extra_body={"custom_params": UNKNOWN})
    with pytest.raises(openai.BadRequestError, match="custom_params"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body={"custom_params": NESTED})
    with pytest.raises(openai.BadRequestError, match=r"input_ids\[1\] = -1"):
        client.completions.create(model="tiny", prompt=[5, -1], max_tokens=4)

    # Streaming /generate starts its 200 response before running the request, so SGLang reports errors
    # as an event; the status inside it is 400, and the request is still never sent on.
    r = requests.post(f"{srv.base_url}/generate", json=_gen([5, 6, -1], stream=True), timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and len(events) == 1, r.text
    assert events[0]["error"]["code"] == 400 and "input_ids[2] = -1" in events[0]["error"]["message"]

    assert _kv_used(srv) == kv_before  # nothing hostile was prefilled into the tree
    assert _good(srv) == before


def test_per_request_prune_is_checked_in_the_http_process() -> None:
    """custom_params sgl_sparse_prune: well-formed ranges inside the prompt (input_ids, or text through the given
    tokenizer length), on a server whose tree evicts, for any method a request can get there (an evicting one is
    told what leaves, SparseMethod.on_prune); else the error names the key."""
    from sgl_sparse.registry import create_method
    from sgl_sparse.request_methods import EVICTION, OFF, MethodResolver

    mixed = MethodResolver(create_method("dense"), EVICTION)
    stock = MethodResolver(create_method("dense"), OFF)

    def check(cp: dict[str, Any], resolver: MethodResolver = mixed, ids: Any = None, text: Any = None) -> None:
        validate_generate_input(text, ids if ids is not None or text is not None else list(range(8, 108)),
                                {"custom_params": cp}, VOCAB, resolver, lambda t: len(t.split()))

    ok = {"sgl_sparse_prune": json.dumps({"ranges": [[0, 10], [50, 100]]})}
    check(ok)
    for method in ("streamingllm", "snapkv", "h2o", "rkv", "skipkv"):
        check({**ok, "sgl_sparse_method": method})
    for server_only in ("pyramidkv", "kvzip", "snapkv+fp8_kv"):  # a server's own method, never a request's
        check(ok, MethodResolver(create_method(server_only)))
    check({"sgl_sparse_prune": '{"ranges": [[1, 3]]}'}, text="a b c d")
    for keep in ({"keep_tokens": 59}, {"keep_tokens": 8, "policy": "knorm"}, {"keep_ratio": 0.25},
                 {"keep_tokens": 0, "policy": "drop"}, {"keep_ratio": 0.5, "policy": "snapkv_global"},
                 {"keep_tokens": 8, "policy": "kvzip_global"}, {"evict_branches": True}, {"evict_branches": False}):
        check({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10], [50, 100]], **keep})})
    for cp, resolver, text, words in (
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 101]]})}, mixed, None, "ranges[0]: [0, 101)"),
        ({"sgl_sparse_prune": '{"ranges": [[1, 5]]}'}, mixed, "a b c d", "<= 4 (the prompt length)"),
        ({"sgl_sparse_prune": '{"ranges": []}'}, mixed, None, "non-empty list"),
        ({"sgl_sparse_prune": '{"ranges": [[3, 3]]}'}, mixed, None, "ranges[0]"),
        ({"sgl_sparse_prune": '{"rangez": [[0, 3]]}'}, mixed, None, "unknown field 'rangez'"),
        ({"sgl_sparse_prune": '{"keep_tokens": 2}'}, mixed, None, "expected '{\"ranges\""),
        # The scored keep: one budget over the union (here 10 + 50 tokens), a policy that scores.
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10], [50, 100]], "keep_tokens": 60})}, mixed, None,
         "keep_tokens: 60 must be less than the ranges' size, 60"),
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10]], "keep_tokens": -1})}, mixed, None,
         "keep_tokens: expected an integer >= 0"),
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10]], "keep_tokens": 2, "policy": "drop"})}, mixed, None,
         "keep_tokens: policy 'drop' keeps nothing"),
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10]], "keep_tokens": 2, "policy": "h2o"})}, mixed,
         None, "policy: 'h2o': expected one of drop, knorm, snapkv_global, kvzip_global"),
        # kvzip_global where replay forwards cannot run (the launcher's handoff says why).
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10]], "keep_tokens": 2, "policy": "kvzip_global"})},
         MethodResolver(create_method("dense"), EVICTION, replay_prune="no replays here"), None,
         "kvzip_global (keep_tokens / keep_ratio) cannot be served here: no replays here"),
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10]], "keep_ratio": 1.0})}, mixed, None,
         "keep_ratio: expected a number in [0, 1)"),
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10]], "keep_ratio": 0.5, "keep_tokens": 5})}, mixed, None,
         "keep_ratio: give keep_tokens or keep_ratio, not both"),
        ({"sgl_sparse_prune": "{not json"}, mixed, None, "invalid JSON"),
        ({"sgl_sparse_prune": json.dumps({"ranges": [[0, 10]], "evict_branches": "yes"})}, mixed, None,
         "evict_branches: expected true or false, got 'yes'"),
        (ok, stock, None, "stock attention lists"),
    ):
        with pytest.raises(RequestValidationError) as e:
            check(cp, resolver, text=text)
        assert "['sgl_sparse_prune']" in str(e.value) and words in str(e.value), (cp, str(e.value))
