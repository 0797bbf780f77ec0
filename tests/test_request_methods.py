"""Per-request method resolution (sgl_sparse/request_methods.py), no server: what a request may choose, the
namespace it gets, and the error naming the custom_params key for everything else."""

from __future__ import annotations

import json

import pytest

from sgl_sparse.errors import SparseConfigError
from sgl_sparse.registry import create_method
from sgl_sparse.request_methods import (
    CONFIG_KEY,
    EVICTION,
    METHOD_KEY,
    OFF,
    MethodResolver,
    RequestMethodError,
    default_policy,
)
from sgl_sparse.rules import PER_REQUEST_DECODE_WINDOW, decode_window


def _snapkv_server(**kw: object) -> MethodResolver:
    return MethodResolver(create_method("snapkv", {"budget": 256}), EVICTION, **kw)  # type: ignore[arg-type]


def test_no_choice_is_the_servers_method() -> None:
    r = _snapkv_server()
    for cp in (None, {}, {"other": 1}, "not a mapping"):
        assert r.resolve(cp) is r.default  # type: ignore[arg-type]
    assert r.default.source == "server" and r.default.method.name == "snapkv"


def test_a_choice_gets_its_own_fingerprint_and_is_cached() -> None:
    r = _snapkv_server()
    a = r.resolve({METHOD_KEY: "snapkv", CONFIG_KEY: json.dumps({"budget": 64, "window_size": 8, "sink_tokens": 4})})
    assert a.method.name == "snapkv" and a.method.config.budget == 64 and a.source == "request"
    assert a.fingerprint != r.default.fingerprint
    # The same choice spelled differently (field order, object instead of JSON text) is the same namespace.
    b = r.resolve({METHOD_KEY: "snapkv", CONFIG_KEY: {"sink_tokens": 4, "window_size": 8, "budget": 64}})
    assert b is a
    dense = r.resolve({METHOD_KEY: "dense"})
    assert dense.method.name == "dense" and not dense.method.evicts
    # The server's own config named explicitly shares the server's namespace.
    same = r.resolve({CONFIG_KEY: json.dumps({"budget": 256})})
    assert same.fingerprint == r.default.fingerprint and same.method is r.default.method
    assert same.describe()["source"] == "request"


@pytest.mark.parametrize(("custom", "key", "needle"), [
    ({METHOD_KEY: "nope"}, METHOD_KEY, "unknown sparse method 'nope'"),
    ({METHOD_KEY: "quest"}, METHOD_KEY, "selection method"),
    ({METHOD_KEY: "pyramidkv"}, METHOD_KEY, "per-layer selector"),
    ({METHOD_KEY: "rkv", CONFIG_KEY: "{\"budget\": 0}"}, CONFIG_KEY, "budget"),
    ({METHOD_KEY: "kivi"}, METHOD_KEY, "KV pool's layout"),
    ({METHOD_KEY: "snapkv+fp8_kv"}, METHOD_KEY, "composition"),
    ({METHOD_KEY: ["snapkv"]}, METHOD_KEY, "must be a method name"),
    ({METHOD_KEY: "snapkv", CONFIG_KEY: "{"}, CONFIG_KEY, "invalid JSON"),
    ({METHOD_KEY: "snapkv", CONFIG_KEY: "3"}, CONFIG_KEY, "JSON object"),
    ({METHOD_KEY: "snapkv", CONFIG_KEY: "/etc/passwd"}, CONFIG_KEY, "invalid JSON"),  # never a file path
    ({METHOD_KEY: "snapkv", CONFIG_KEY: '{"budget": 0}'}, CONFIG_KEY, "'budget'"),
    ({METHOD_KEY: "snapkv", CONFIG_KEY: '{"bugdet": 5}'}, CONFIG_KEY, "'bugdet'"),
    ({CONFIG_KEY: '{"budget": "many"}'}, CONFIG_KEY, "'budget'"),
])
def test_bad_choices_name_the_key(custom: dict, key: str, needle: str) -> None:
    with pytest.raises(RequestMethodError) as e:
        _snapkv_server().resolve(custom)
    assert e.value.key == key and needle in str(e.value), str(e.value)


def test_decode_observers_fit_the_servers_decode_window() -> None:
    """A request's method keeps its decode queries in the server's ring (rules.decode_window): up to its width."""
    server = _snapkv_server()
    assert server.decode_window == PER_REQUEST_DECODE_WINDOW == 128  # h2o's default window fits
    assert server.resolve({METHOD_KEY: "h2o", CONFIG_KEY: json.dumps({"budget": 512})}).method.name == "h2o"
    wide = {METHOD_KEY: "h2o", CONFIG_KEY: json.dumps({"budget": 512, "window_size": 129})}
    with pytest.raises(RequestMethodError, match="last 129 decode queries .window_size., this server keeps 128") as e:
        server.resolve(wide)
    assert e.value.key == CONFIG_KEY
    # A window only the prompt uses (decode scoring off) needs no ring.
    prompt_only = {METHOD_KEY: "h2o", CONFIG_KEY: json.dumps({"budget": 512, "window_size": 500,
                                                              "evict_interval": 0})}
    assert server.resolve(prompt_only).method.name == "h2o"


def test_decode_window_widths() -> None:
    assert decode_window(create_method("snapkv")) == 0  # prompt only
    assert decode_window(create_method("dense")) == 0
    assert decode_window(create_method("h2o")) == 128
    assert decode_window(create_method("rkv")) == 32  # 8, and a prune's 32 from the same ring
    assert decode_window(create_method("snapkv", {"decode_interval": 64, "window_size": 48})) == 48
    assert decode_window(create_method("dense"), PER_REQUEST_DECODE_WINDOW) == PER_REQUEST_DECODE_WINDOW
    assert decode_window(create_method("snapkv"), 8) == 32
    assert decode_window(create_method("h2o", {"window_size": 200}), PER_REQUEST_DECODE_WINDOW) == 200


def test_a_server_without_a_request_window_refuses_decode_scoring_per_request() -> None:
    server = MethodResolver(create_method("snapkv", {"budget": 256}), EVICTION, request_decode_window=0)
    assert server.decode_window == 0
    with pytest.raises(RequestMethodError, match="--sparse-request-decode-window 128") as e:
        server.resolve({METHOD_KEY: "h2o"})
    assert e.value.key == CONFIG_KEY
    assert server.resolve({METHOD_KEY: "h2o", CONFIG_KEY: json.dumps({"evict_interval": 0})}).method.name == "h2o"


def test_policy_off_refuses_any_choice_and_says_why() -> None:
    dense = MethodResolver(create_method("dense"), OFF)
    with pytest.raises(RequestMethodError, match="--sparse-request-methods eviction") as e:
        dense.resolve({METHOD_KEY: "snapkv"})
    assert e.value.key == METHOD_KEY
    quest = MethodResolver(create_method("quest"), OFF)
    with pytest.raises(RequestMethodError, match="selection method") as e:
        quest.resolve({CONFIG_KEY: "{}"})
    assert e.value.key == CONFIG_KEY


def test_policies_by_server_method() -> None:
    assert default_policy(create_method("snapkv")) == EVICTION
    assert default_policy(create_method("dense")) == OFF
    assert default_policy(create_method("quest")) == OFF
    assert default_policy(create_method("snapkv+fp8_kv")) == OFF
    with pytest.raises(SparseConfigError, match="selection method"):
        MethodResolver(create_method("quest"), EVICTION)
    with pytest.raises(SparseConfigError, match="expected one of"):
        MethodResolver(create_method("dense"), "sometimes")
