"""SGLang's frontend language with a per-request method: a ``RuntimeEndpoint`` whose every request carries
``custom_params`` choosing the method (sgl_sparse/request_methods.py), since ``sgl.gen`` has no field for it.

    import sglang as sgl
    from sgl_sparse.frontend import SparseEndpoint

    sub_agent = SparseEndpoint("http://localhost:30000", method="snapkv", config={"budget": 1024})
    state = my_program.run(question=q, backend=sub_agent)   # or sgl.set_default_backend(sub_agent)

Every request of the program (``gen``, ``select``'s scoring, prefix caching) is served by that method, in its
own prefix-tree namespace; the server must take per-request methods (``--sparse-request-methods eviction``,
the default on an eviction server).

Prefix-Cache Pruning from a client (docs/prefix-cache-pruning.md): :func:`prune`, :func:`match` and
:func:`inspect` call ``/v1/prefix_cache/*`` on a URL or an endpoint and return the server's answer as a dict;
a rejected body raises :class:`PruneRequestError` (its ``status``, ``param`` and ``message`` are the server's)::

    from sgl_sparse.frontend import prune
    r = prune("http://localhost:30000", messages=history, roles=["tool"], lag=2)
    r["status"], r["pruned_tokens"], r["freed_slots"]
    prune(url, token_ids=ids, ranges=[[100, 900]], keep_tokens=80)   # keep the 80 the knorm score ranks highest

``SparseEndpoint.prune`` / ``.match`` do the same in the endpoint's own method namespace (its requests' KV lives
there, so a prune without it would look in the server's namespace and find nothing).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import requests
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from sgl_sparse.request_methods import CONFIG_KEY, METHOD_KEY


class PruneRequestError(RuntimeError):
    """The server refused a prefix-cache request (HTTP 4xx/5xx): ``param`` names the field at fault."""

    def __init__(self, status: int, message: str, param: str | None) -> None:
        super().__init__(f"HTTP {status}" + (f" ({param})" if param else "") + f": {message}")
        self.status, self.message, self.param = status, message, param


def _target(url_or_endpoint: str | RuntimeEndpoint) -> tuple[str, dict[str, str], dict[str, Any]]:
    """(base URL, headers, namespace keys) of a URL or an endpoint; a :class:`SparseEndpoint` names its
    method's namespace, since that is where its requests' KV is cached."""
    if isinstance(url_or_endpoint, str):
        return url_or_endpoint.rstrip("/"), {}, {}
    headers = {"Authorization": f"Bearer {url_or_endpoint.api_key}"} if url_or_endpoint.api_key else {}
    keys = dict(getattr(url_or_endpoint, "custom_params", {}))
    return url_or_endpoint.base_url.rstrip("/"), headers, keys


def _selector(messages: Sequence[Mapping[str, Any]] | None, token_ids: Sequence[int] | None,
              text: str | None) -> dict[str, Any]:
    given = {k: v for k, v in (("messages", messages), ("token_ids", token_ids), ("text", text)) if v is not None}
    if len(given) != 1:
        raise ValueError(f"give exactly one of messages, token_ids, text (got {', '.join(given) or 'none'})")
    return {k: (list(v) if k != "text" else v) for k, v in given.items()}


def _call(url_or_endpoint: str | RuntimeEndpoint, path: str, body: dict[str, Any], method: str | None,
          config: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    base, headers, keys = _target(url_or_endpoint)
    if method is not None:
        keys[METHOD_KEY] = method
    if config is not None:
        keys[CONFIG_KEY] = json.dumps(config)
    r = requests.post(f"{base}/v1/prefix_cache/{path}", json={**body, **keys}, headers=headers, timeout=timeout)
    if r.status_code >= 400:
        try:
            err = r.json()
        except ValueError:
            err = {"message": r.text[:500]}
        raise PruneRequestError(r.status_code, str(err.get("message", "")), err.get("param"))
    out: dict[str, Any] = r.json()
    return out


def prune(url_or_endpoint: str | RuntimeEndpoint, *, messages: Sequence[Mapping[str, Any]] | None = None,
          token_ids: Sequence[int] | None = None, text: str | None = None,
          ranges: Sequence[Sequence[int]] | None = None, roles: Sequence[str] | None = None, lag: int = 0,
          keep_tokens: int = 0, policy: str | None = None, method: str | None = None,
          config: dict[str, Any] | None = None, timeout: float = 60.0, evict_branches: bool = False,
          keep_ratio: float | None = None) -> dict[str, Any]:
    """``POST /v1/prefix_cache/prune``: hide ``ranges`` (logical ``[start, end)`` positions) or the content of
    ``roles`` messages but the ``lag`` most recent (``messages`` selector only) from the cached sequence's
    continuations; ``keep_tokens`` > 0 keeps that many of them (one budget over all the ranges), the ones the
    ``policy``'s score ranks highest (``"knorm"``, the default then: lowest key norm; ``"snapkv_global"``: the
    attention of the sequence's last 32 tokens, which the server re-forwards for it; ``"kvzip_global"``: the
    attention of KVzip's reconstruction of the ranges, which the server runs for it). Returns the server's result
    (``status`` completed | blocked | failed, ``pruned_tokens``, ``kept_tokens``, ``freed_slots``, ...):
    ``blocked`` and ``failed`` are answers, not exceptions; a body the server rejects raises
    :class:`PruneRequestError`. ``method`` / ``config`` name a per-request method's namespace;
    ``evict_branches`` first evicts idle cached branches below the ranges (e.g. a reply as generated beside its
    re-rendered history), so the ranges' KV is freed rather than kept for them; ``keep_ratio`` (instead of
    ``keep_tokens``) keeps that fraction of the ranges' tokens, which the server finds (e.g. by ``roles``)."""
    body = _selector(messages, token_ids, text)
    if evict_branches:
        body["evict_branches"] = True
    if (ranges is None) == (roles is None):
        raise ValueError("give either ranges or roles")
    if ranges is not None:
        body["ranges"] = [list(r) for r in ranges]
    else:
        body["roles"], body["lag"] = list(roles or []), lag
    if keep_tokens:
        body["keep_tokens"] = keep_tokens
    if keep_ratio is not None:
        body["keep_ratio"] = keep_ratio
    if policy is not None:
        body["policy"] = policy
    return _call(url_or_endpoint, "prune", body, method, config, timeout)


def match(url_or_endpoint: str | RuntimeEndpoint, *, messages: Sequence[Mapping[str, Any]] | None = None,
          token_ids: Sequence[int] | None = None, text: str | None = None, method: str | None = None,
          config: dict[str, Any] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """``POST /v1/prefix_cache/match``: ``{tokens, matched_tokens, resident_tokens, hidden_tokens}``."""
    return _call(url_or_endpoint, "match", _selector(messages, token_ids, text), method, config, timeout)


def inspect(url_or_endpoint: str | RuntimeEndpoint, *, messages: Sequence[Mapping[str, Any]] | None = None,
            token_ids: Sequence[int] | None = None, text: str | None = None, method: str | None = None,
            config: dict[str, Any] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """``POST /v1/prefix_cache/inspect``: ``match``'s answer plus the tree path (``nodes``)."""
    return _call(url_or_endpoint, "inspect", _selector(messages, token_ids, text), method, config, timeout)


class SparseEndpoint(RuntimeEndpoint):
    def __init__(self, base_url: str, method: str | None = None, config: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if method is None and config is None:
            raise ValueError("SparseEndpoint: give a method, a config, or both (else use RuntimeEndpoint)")
        self.custom_params: dict[str, Any] = {}
        if method is not None:
            self.custom_params[METHOD_KEY] = method
        if config is not None:
            self.custom_params[CONFIG_KEY] = json.dumps(config)
        super().__init__(base_url, **kwargs)

    def _with_method(self, data: dict[str, Any]) -> None:
        sp = data.setdefault("sampling_params", {})
        sp["custom_params"] = {**(sp.get("custom_params") or {}), **self.custom_params}

    # Every request RuntimeEndpoint sends for a program's state goes through _add_images (generate, streaming,
    # select's scoring, lazy commits); cache_prefix does not.
    def _add_images(self, s: Any, data: dict[str, Any]) -> None:
        super()._add_images(s, data)
        self._with_method(data)

    def cache_prefix(self, prefix_str: str) -> None:
        data = {"text": prefix_str, "sampling_params": {"max_new_tokens": 0}}
        self._with_method(data)
        self._assert_success(self._post("/generate", data))

    def _post(self, path: str, data: dict[str, Any]) -> Any:
        from sglang.utils import http_request

        return http_request(self.base_url + path, json=data, api_key=self.api_key, verify=self.verify)

    def prune(self, **kwargs: Any) -> dict[str, Any]:
        """:func:`prune` in this endpoint's method namespace."""
        return prune(self, **kwargs)

    def match(self, **kwargs: Any) -> dict[str, Any]:
        """:func:`match` in this endpoint's method namespace."""
        return match(self, **kwargs)
