"""Per-request methods: which method and config serve one request.

A request picks its own method through SGLang's ``custom_params`` (the one per-request field that
reaches the scheduler from ``/generate``, the OpenAI routes through ``extra_body`` and the frontend's
``sgl.gen``)::

    {"custom_params": {"sgl_sparse_method": "snapkv", "sgl_sparse_config": "{\\"budget\\": 1024}"}}

``sgl_sparse_config`` is the same JSON object as ``--sparse-config`` (as a string, or a flat object:
SGLang's msgspec IPC rejects anything deeper; never a file path, which the server would read), and
alone it configures the server's method. The server's ``--sparse-method`` serves requests that name
none. Only the eviction family and ``dense`` may be chosen per request: they differ only in which
slots of a request's row stay live and in host-side bookkeeping keyed by request, while a selection
method's page metadata and attention path, and a quantization method's pool layout, are server-wide.

The same :class:`MethodResolver` runs in the HTTP process (validation: a bad request gets HTTP 400
naming the field, before it reaches the scheduler; the method reported in ``meta_info``) and in the
scheduler (the method that serves it). Requests under different fingerprints never share prefix-tree
entries (the fingerprint namespaces them), so a dense request never reads KV a SnapKV request evicted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sgl_sparse.compose import is_composed
from sgl_sparse.contract import SparseMethod
from sgl_sparse.errors import SparseConfigError
from sgl_sparse.prune.spec import (
    KVZIP_GLOBAL,
    REQUEST_POLICIES,
    REQUEST_SCORED,
    KeepError,
    PruneSpec,
    RangeError,
    parse_evict_branches,
    parse_keep,
    parse_ranges,
)
from sgl_sparse.registry import create_method
from sgl_sparse.rules import PER_REQUEST_DECODE_WINDOW, decode_window, served_hooks_problem

METHOD_KEY = "sgl_sparse_method"
CONFIG_KEY = "sgl_sparse_config"
KEYS = frozenset({METHOD_KEY, CONFIG_KEY})
# Per-request Prefix-Cache Pruning (docs/prefix-cache-pruning.md, "Per request"): a JSON string
# ``{"ranges": [[l, r], ...]}`` of this request's prompt positions hidden from its attention after its final
# prefill, and from the sequence the tree stores at its finish; with ``keep_tokens`` / ``keep_ratio`` and a
# ``policy``, the best-scored of them stay (sgl_sparse/prune/keep.py). Any method serves it: the runtime tells the
# method which positions leave (``SparseMethod.on_prune``) before the method plans, so state indexed by the
# retained set (H2O's scores, PyramidKV's layer masks) stays aligned.
PRUNE_KEY = "sgl_sparse_prune"
PRUNE_FIELDS = frozenset({"ranges", "keep_tokens", "keep_ratio", "policy", "evict_branches"})

OFF, EVICTION = "off", "eviction"
POLICIES = (OFF, EVICTION)
FLAG = "--sparse-request-methods"

_CACHE_LIMIT = 256  # distinct (method, config) pairs remembered; each is a method object and a digest


class RequestMethodError(ValueError):
    """A per-request method or config that cannot serve; ``key`` is the custom_params key at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Served:
    """The method serving a request and its prefix-tree namespace; ``source`` says who chose it."""

    method: SparseMethod[Any]
    fingerprint: str
    source: str  # "server" (--sparse-method) or "request" (custom_params)

    def describe(self) -> dict[str, Any]:
        """What ``meta_info["sgl_sparse"]`` reports."""
        return {"method": self.method.name, "config": self.method.config.to_dict(),
                "fingerprint": self.fingerprint, "source": self.source}


def default_policy(method: SparseMethod[Any]) -> str:
    """``eviction`` where the server's own method already evicts (its backends then serve any eviction
    method at no extra cost), else ``off`` (a dense server keeps SGLang's stock attention path unless
    asked)."""
    return EVICTION if method.evicts and method.store is None and method.selector is None else OFF


def policy_problem(method: SparseMethod[Any], policy: str) -> str | None:
    """Why ``--sparse-method method`` cannot take ``policy`` (``None``: it can)."""
    if policy not in POLICIES:
        return f"{FLAG} {policy}: expected one of {', '.join(POLICIES)}"
    if policy == EVICTION and (why := _server_wide(method)) is not None:
        return f"{FLAG} eviction with --sparse-method {method.name}: {why}"
    return None


def _server_wide(method: SparseMethod[Any]) -> str | None:
    if method.store is not None:
        return (f"{method.name} owns the KV pool's layout ({type(method.store).__name__}), which every request "
                "of the server shares")
    if method.selector is not None:
        if method.evicts:  # PyramidKV: per-layer sets read through a static selector
            return (f"{method.name} reads each layer through its own per-layer selector, an attention path the "
                    "server is started with (--sparse-method " + method.name + ")")
        return (f"{method.name} is a selection method: its page metadata and its attention path serve every "
                "request of the server")
    return None


class MethodResolver:
    """``custom_params`` -> :class:`Served`. ``policy``: ``off`` (every request gets the server's method;
    the keys are an error) or ``eviction``. ``request_decode_window``: the decode queries a request's own method
    may observe (--sparse-request-decode-window); the server's ring (:func:`~sgl_sparse.rules.decode_window`) is at
    least that wide."""

    def __init__(self, default: SparseMethod[Any], policy: str = OFF, scored_prune: str | None = None,
                 replay_prune: str | None = None, request_decode_window: int = PER_REQUEST_DECODE_WINDOW) -> None:
        if (why := policy_problem(default, policy)) is not None:
            raise SparseConfigError(why)
        self.default = Served(default, default.config.fingerprint(), "server")
        self.policy = policy
        self.decode_window = decode_window(default, request_decode_window if policy == EVICTION else 0)
        # Why a request's own prune cannot keep a scored part of its ranges here (the launcher's handoff); None: it can.
        self.scored_prune = scored_prune
        # Why one cannot keep by kvzip_global (replay forwards) here; None: it can.
        self.replay_prune = replay_prune
        self._cache: dict[tuple[str, str], Served] = {}

    def resolve(self, custom_params: Mapping[str, Any] | None) -> Served:
        """The request's method; raises :class:`RequestMethodError` naming the key at fault."""
        if not isinstance(custom_params, Mapping):
            return self.default
        name, config = custom_params.get(METHOD_KEY), custom_params.get(CONFIG_KEY)
        if name is None and config is None:
            return self.default
        key = METHOD_KEY if name is not None else CONFIG_KEY
        if self.policy == OFF:
            why = _server_wide(self.default.method) or f"start it with {FLAG} eviction to choose methods per request"
            raise RequestMethodError(key, f"this server serves --sparse-method {self.default.method.name} to every "
                                          f"request: {why}")
        if name is None:
            name = self.default.method.name
        if not isinstance(name, str):
            raise RequestMethodError(METHOD_KEY, f"must be a method name (a string), got {type(name).__name__}")
        fields = _config_fields(config)
        cache_key = (name, json.dumps(fields, sort_keys=True))
        served = self._cache.get(cache_key)
        if served is None:
            served = self._build(name, fields)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.pop(next(iter(self._cache)))
            self._cache[cache_key] = served
        return served

    def _build(self, name: str, fields: dict[str, Any]) -> Served:
        if is_composed(name):
            raise RequestMethodError(METHOD_KEY, f"{name!r} is a composition: its quantized pool is server-wide; "
                                                 "start a server with --sparse-method " + name)
        try:
            method = create_method(name, fields)
        except SparseConfigError as e:
            unknown_method = str(e).startswith("unknown sparse method")
            raise RequestMethodError(METHOD_KEY if unknown_method else CONFIG_KEY, str(e)) from None
        if (why := _server_wide(method)) is not None:
            raise RequestMethodError(METHOD_KEY, f"{why}: it cannot be chosen per request; start a server with "
                                                 f"--sparse-method {name}")
        if (why := served_hooks_problem(method)) is not None:
            raise RequestMethodError(METHOD_KEY, why)
        if (w := method.observation_window()) > self.decode_window and method.observes_decode():
            raise RequestMethodError(CONFIG_KEY, f"{name} observes its last {w} decode queries (window_size), this "
                                                 f"server keeps {self.decode_window} a request: turn its decode "
                                                 "scoring off (e.g. h2o's evict_interval 0, snapkv's decode_interval "
                                                 f"0) or start the server with --sparse-request-decode-window {w}")
        fp = method.config.fingerprint()
        if fp == self.default.fingerprint:
            return Served(self.default.method, fp, "request")
        if method.runs_replays:
            raise RequestMethodError(METHOD_KEY, f"{name} runs replay forwards whose prompts the launcher derives "
                                                 "from the served tokenizer and which are served on --device cpu "
                                                 f"only: it cannot be chosen per request; start a server with "
                                                 f"--sparse-method {name}")
        return Served(method, fp, "request")


def _config_fields(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise RequestMethodError(CONFIG_KEY, f"invalid JSON ({e}); expected a JSON object, e.g. "
                                                 "'{\"budget\": 1024}'") from None
    if not isinstance(config, Mapping):
        raise RequestMethodError(CONFIG_KEY, f"expected a JSON object of config fields, got {type(config).__name__}")
    return dict(config)


def parse_prune_param(value: Any, prompt_len: int | None) -> PruneSpec:
    """``custom_params[PRUNE_KEY]`` -> a :class:`~sgl_sparse.prune.spec.PruneSpec`: sorted, merged ``[l, r)`` ranges
    of prompt positions, ``0 <= l < r <= prompt_len`` (unchecked against the prompt when its length is not known
    here), and the scored keep (``keep_tokens`` or ``keep_ratio``, ``policy``) as ``POST /v1/prefix_cache/prune``
    takes it, with ``snapkv_global`` besides ``knorm`` (the default when something is kept: the prompt's last
    queries score the ranges). Raises :class:`RequestMethodError` naming the key."""
    shape = ("'{\"ranges\": [[start, end], ...]}', optionally with keep_tokens or keep_ratio and policy, and "
             "evict_branches (on /v1/chat/completions, '{\"roles\": [\"tool\"], \"lag\": n}' may replace ranges)")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RequestMethodError(PRUNE_KEY, f"invalid JSON ({e}); expected {shape}") from None
    if not isinstance(value, Mapping) or "ranges" not in value or not set(value) <= PRUNE_FIELDS:
        extra = sorted(set(value) - PRUNE_FIELDS) if isinstance(value, Mapping) else []
        raise RequestMethodError(PRUNE_KEY, (f"unknown field {extra[0]!r}; " if extra else "") + f"expected {shape}")
    try:
        merged = parse_ranges(value["ranges"], prompt_len, "the prompt length")
    except RangeError as e:
        raise RequestMethodError(PRUNE_KEY, f"{e.field}: {e}") from None
    try:
        # Our servers' pools have pages of one token (a request's own prune hides single positions).
        keep, policy = parse_keep(value, sum(hi - lo for lo, hi in merged), 1, REQUEST_POLICIES, REQUEST_SCORED)
        evict = parse_evict_branches(value)
    except KeepError as e:
        raise RequestMethodError(PRUNE_KEY, f"{e.field}: {e}") from None
    return PruneSpec(tuple(merged), keep, policy, evict)


def prune_problem(resolver: MethodResolver, spec: PruneSpec | None = None) -> str | None:
    """Why a request on this server cannot prune its own prompt as ``spec`` asks (``None``: it can). Every method a
    request can get here can: a dense one has nothing to realign, an evicting one is told what leaves
    (``on_prune``). A scored keep also needs the prompt's last queries and float keys (``resolver.scored_prune``)."""
    if not (resolver.default.method.evicts or resolver.policy == EVICTION):
        return (f"this server reads SGLang's stock attention lists, which cannot skip pruned KV: start it with an "
                f"eviction method or {FLAG} eviction")
    if spec is not None and spec.scores and resolver.scored_prune is not None:
        return f"{spec.policy} (keep_tokens / keep_ratio) cannot be served here: {resolver.scored_prune}"
    if spec is not None and spec.scores and spec.policy == KVZIP_GLOBAL and resolver.replay_prune is not None:
        return f"{KVZIP_GLOBAL} (keep_tokens / keep_ratio) cannot be served here: {resolver.replay_prune}"
    return None
