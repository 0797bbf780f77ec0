"""The body of the Prefix-Cache Pruning route (docs/prefix-cache-pruning.md), SGLang-free: a selector
(``token_ids``, ``text`` or ``messages``) and the prune's fields parsed and checked in the HTTP process, the ranges
of a chat's roles, and the answers of every rank merged into one. ``sgl_sparse/integration/prune_route.py`` wires
them to SGLang's HTTP server and schedulers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sgl_sparse.prune.spec import (
    ROUTE_POLICIES,
    ROUTE_SCORED,
    KeepError,
    RangeError,
    parse_evict_branches,
    parse_keep,
    parse_ranges,
)
from sgl_sparse.request_methods import CONFIG_KEY, METHOD_KEY, RequestMethodError


class BadPruneRequest(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _int_list(value: Any, field: str, vocab_size: int | None = None) -> list[int]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise BadPruneRequest(field, "expected a non-empty list of integers")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadPruneRequest(field, "expected a non-empty list of integers")
    if vocab_size is not None:
        bad = next((i for i, t in enumerate(value) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadPruneRequest(f"{field}[{bad}]", f"{value[bad]} is not a token id of this model (vocab size "
                                                      f"{vocab_size})")
    return list(value)


def sequence_ranges(value: Any, n_tokens: int) -> list[tuple[int, int]]:
    """``[[L, R], ...]`` of logical positions, ``0 <= L < R <= n_tokens``, sorted and merged."""
    try:
        return parse_ranges(value, n_tokens, "the selected sequence's length")
    except RangeError as e:
        raise BadPruneRequest(e.field, str(e)) from None


def message_spans(render: Any, messages: list[Any]) -> list[tuple[int, int]]:
    """Token span of each message's content in ``render(messages)``: ``render(messages[:i])`` gives where message
    ``i`` starts; the template's own markers around its content (found by rendering it with empty content) are
    left out, so pruning a message never removes the role markers the next turn's rendering repeats."""
    spans = []
    for i, msg in enumerate(messages):
        before = render(messages[:i]) if i else []
        full = render(messages[:i + 1])
        empty = render([*messages[:i], {**msg, "content": ""}])
        a, b, c = len(before), full, empty
        head = 0
        while a + head < min(len(b), len(c)) and b[a + head] == c[a + head]:
            head += 1
        tail = 0
        while tail < min(len(b), len(c)) - a - head and b[-1 - tail] == c[-1 - tail]:
            tail += 1
        spans.append((a + head, len(b) - tail))
    return spans


def role_ranges(spans: list[tuple[int, int]], messages: list[Any], roles: Any, lag: Any) -> list[tuple[int, int]]:
    """The content spans of ``roles`` messages except the ``lag`` most recent of them."""
    if (not isinstance(roles, Sequence) or isinstance(roles, str) or not roles
            or not all(isinstance(r, str) for r in roles)):
        raise BadPruneRequest("roles", "expected a non-empty list of role names, e.g. [\"tool\"]")
    if not isinstance(lag, int) or isinstance(lag, bool) or lag < 0:
        raise BadPruneRequest("lag", f"expected an integer >= 0 (how many most recent such messages to spare), got "
                                     f"{lag!r}")
    chosen = [i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") in roles]
    chosen = chosen[:len(chosen) - lag] if lag else chosen
    return [spans[i] for i in chosen if spans[i][1] > spans[i][0]]


def parse_body(body: Any, tokenize: Any, render: Any, vocab_size: int | None, resolve: Any,
               need_ranges: bool, page_size: int = 1) -> dict[str, Any]:
    """The request as the scheduler needs it: ``token_ids``, ``fingerprint`` and (for a prune) ``ranges``,
    ``keep_tokens`` and ``policy``. ``tokenize(text) -> ids``; ``render(messages) -> ids``;
    ``resolve(custom_params) -> Served``; ``page_size``: the pool's (a kept page is whole)."""
    if not isinstance(body, Mapping):
        raise BadPruneRequest("body", "expected a JSON object")
    allowed = {"token_ids", "text", "messages", "ranges", "roles", "lag", "keep_tokens", "keep_ratio", "policy",
               "evict_branches", METHOD_KEY, CONFIG_KEY}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadPruneRequest(unknown[0], f"unknown field; known fields: {', '.join(sorted(allowed))}")
    given = [k for k in ("token_ids", "text", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise BadPruneRequest("token_ids", "give exactly one selector: token_ids, text or messages (got "
                                           f"{', '.join(given) or 'none'})")
    messages = None
    if given[0] == "token_ids":
        token_ids = _int_list(body["token_ids"], "token_ids", vocab_size)
    elif given[0] == "text":
        if not isinstance(body["text"], str) or not body["text"]:
            raise BadPruneRequest("text", "expected a non-empty string")
        token_ids = list(tokenize(body["text"]))
    else:
        messages = body["messages"]
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages)):
            raise BadPruneRequest("messages", "expected a non-empty list of chat messages with a role")
        try:
            token_ids = list(render(messages))
        except Exception as e:  # the template's own error (e.g. a role it does not know)
            raise BadPruneRequest("messages", f"the chat template cannot render them: {e}") from None
    try:
        served = resolve({k: body[k] for k in (METHOD_KEY, CONFIG_KEY) if k in body})
    except RequestMethodError as e:
        raise BadPruneRequest(e.key, str(e)) from None
    out: dict[str, Any] = {"token_ids": token_ids, "fingerprint": served.fingerprint,
                           # as given: the route's snapkv_global sends them on with its internal request
                           **{k: body[k] for k in (METHOD_KEY, CONFIG_KEY) if k in body}}
    if not need_ranges:
        return out
    if body.get("roles") is not None:
        if body.get("ranges") is not None:
            raise BadPruneRequest("roles", "give either ranges or roles, not both")
        if messages is None:
            raise BadPruneRequest("roles", "selecting by role needs the messages selector")
        ranges = role_ranges(message_spans(render, messages), messages, body["roles"], body.get("lag", 0))
        out["ranges"] = sequence_ranges([list(r) for r in ranges], len(token_ids)) if ranges else []
    else:
        out["ranges"] = sequence_ranges(body.get("ranges"), len(token_ids))
    size = sum(hi - lo for lo, hi in out["ranges"])
    try:
        keep, policy = parse_keep(body, size, page_size, ROUTE_POLICIES, ROUTE_SCORED)
    except KeepError as e:
        raise BadPruneRequest(e.field, str(e)) from None
    out["keep_tokens"], out["policy"] = keep, policy
    try:
        out["evict_branches"] = parse_evict_branches(body)
    except KeepError as e:
        raise BadPruneRequest(e.field, str(e)) from None
    return out


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from every DP rank's (each holds its own tree; the sequence lives on one of them)."""
    for status in ("completed", "blocked"):
        hit = [r for r in results if r.get("status") == status]
        if hit:
            best = max(hit, key=lambda r: r.get("matched_tokens", 0))
            return {**best, **{k: sum(r.get(k, 0) for r in results) for k in ("freed_slots", "evicted_branch_slots")}}
    return max(results, key=lambda r: r.get("matched_tokens", 0)) if results else {"status": "failed"}


def route_counts(before: dict[str, Any], after: dict[str, Any], ranges: list[tuple[int, int]]) -> dict[str, Any]:
    """The route's result fields from two ``inspect`` answers around a prune: resident positions of the ranges it took
    up (``pruned_tokens``), of them resident still (``kept_tokens``), the slots the sequence's path no longer holds
    (``freed_slots``: shared nodes keep theirs), and what a continuation now sees."""
    def resident_in_ranges(view: dict[str, Any]) -> int:
        hidden = [tuple(r) for r in view.get("hidden_ranges", [])]
        total = sum(hi - lo for lo, hi in ranges)
        return int(total - sum(max(0, min(hi, b) - max(lo, a)) for lo, hi in ranges for a, b in hidden))

    def slots(view: dict[str, Any]) -> int:
        return sum(int(n["resident"]) for n in view.get("nodes", []))

    took = resident_in_ranges(before)
    return {"matched_tokens": after.get("matched_tokens", 0), "pruned_tokens": took,
            "kept_tokens": resident_in_ranges(after), "freed_slots": slots(before) - slots(after),
            "resident_tokens": after.get("resident_tokens", 0)}


def chat_ranges(render: Any, messages: list[Any], prompt_ids: list[int], roles: Any, lag: Any) -> list[list[int]]:
    """The ranges of ``{"roles", "lag"}`` over a chat request's own prompt: the content spans of those messages
    but the ``lag`` most recent, as ``POST /v1/prefix_cache/prune`` selects them. ``render`` (the tokenizer's
    template) must reproduce the start of the prompt the route rendered, else the spans would point elsewhere."""
    spans = role_ranges(message_spans(render, messages), messages, roles, lag)
    full = list(render(messages))
    if prompt_ids[:len(full)] != full:
        raise BadPruneRequest("roles", "the chat template this route used renders these messages differently "
                                       "from the tokenizer's template (e.g. tools or template kwargs): give ranges")
    return [list(r) for r in spans]
