"""The Prefix-Cache Pruning HTTP API (docs/prefix-cache-pruning.md): SGLang's side of it. The body is parsed by
:mod:`sgl_sparse.prune.body`, the keys scored by :mod:`sgl_sparse.prune.keep`, the tree operation is
:mod:`sgl_sparse.prune.tree_ops`.

    POST /v1/prefix_cache/prune        {selector, ranges | roles + lag, keep_tokens, policy} -> 202
    GET  /v1/prefix_cache/prune/{id}   the prune's status: completed | blocked | failed, tokens pruned, slots freed
    POST /v1/prefix_cache/match        {selector}: how many of its tokens the tree serves, and how many are resident
    POST /v1/prefix_cache/inspect      {selector}: the same, with the path of tree nodes

A selector is exactly one of ``token_ids``, ``text`` (tokenized as ``/generate`` tokenizes it) or ``messages``
(an OpenAI chat, rendered with the tokenizer's chat template, no generation prompt); ``sgl_sparse_method`` /
``sgl_sparse_config`` pick a per-request method's namespace (default: the server's). ``keep_tokens`` > 0 keeps
that many of the ranges' tokens (one budget over their union) by the ``policy``'s score of the keys in the pool
(:mod:`sgl_sparse.prune.keep`); each scheduler scores its own heads and the TP group sums the scores.

Plumbing (../shared/notes/sglang-0.5.17-wave2-map.md §C.1-C.2): the routes are added to SGLang's FastAPI app in
the launcher process before ``run_server``; the request goes to every scheduler (every DP rank, every TP rank)
as a control request through a ``FanOutCommunicator`` registered in ``_COMMUNICATOR_SPECS`` before the
TokenizerManager is built; each scheduler runs it between batches (a handler added to its request dispatcher)
and answers at once. A prune is applied when the POST returns (the 202 and the id keep SparseEngine's polling
API); ``blocked`` (a running request holds the range) is final for that id: retry with a new POST.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from sglang.srt.managers.io_struct import BaseReq

from sgl_sparse.prune import tree_ops
from sgl_sparse.prune.body import BadPruneRequest, chat_ranges, merge, parse_body, route_counts
from sgl_sparse.prune.keep import pool_scorer
from sgl_sparse.prune.spec import (
    BY_REQUEST,
    KNORM,
    REQUEST_POLICIES,
    REQUEST_SCORED,
    SNAPKV_GLOBAL,
    SNAPKV_WINDOW,
    KeepError,
    parse_evict_branches,
    parse_keep,
)
from sgl_sparse.request_methods import CONFIG_KEY, METHOD_KEY

PRUNE, INSPECT = "prune", "inspect"
_RESULTS_KEPT = 4096  # prune ids remembered for GET (oldest dropped first)


class SparsePruneReqInput(BaseReq):
    op: str = PRUNE
    body: str = "{}"  # JSON: token_ids, extra_key, ranges


class SparsePruneReqOutput(BaseReq):
    result: str = "{}"  # JSON: one rank's result


# -- scheduler side ---------------------------------------------------------------------------------

def handle(scheduler: Any, req: SparsePruneReqInput) -> SparsePruneReqOutput:
    from sgl_sparse.integration.tp import scores_all_reduce
    from sgl_sparse.radix.tree import SparseRadixCache

    tree = scheduler.tree_cache
    try:
        body = json.loads(req.body)
        if not isinstance(tree, SparseRadixCache):
            result: dict[str, Any] = {"status": "failed", "message": "this scheduler's prefix cache is not ours"}
        elif tree.disable:
            result = {"status": "failed", "message": "the radix cache is disabled (--disable-radix-cache)"}
        else:
            from sgl_sparse.integration.runtime import get_runtime

            fp = body["fingerprint"]
            extra_key = None if fp == get_runtime().fingerprint else f"sgl_sparse={fp}"
            if req.op == PRUNE:
                keep = int(body.get("keep_tokens", 0))
                score = pool_scorer(tree.token_to_kv_pool_allocator.get_kvcache(), body.get("policy", KNORM),
                                    scores_all_reduce()) if keep else None
                result = tree_ops.prune(tree, body["token_ids"], extra_key, [tuple(r) for r in body["ranges"]],
                                          keep, score, bool(body.get("evict_branches", False))).to_dict()
            else:
                result = tree_ops.inspect(tree, body["token_ids"], extra_key)
    except Exception as e:  # a bug must not take the scheduler down: report it
        result = {"status": "failed", "message": f"{type(e).__name__}: {e}"}
    return SparsePruneReqOutput(rid=req.rid, result=json.dumps(result))


def after_init_request_dispatcher(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``Scheduler.init_request_dispatcher``: our control request joins the scheduler's dispatcher."""
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher([(SparsePruneReqInput, lambda r: handle(scheduler, r))])
    return result


DISPATCHER_TARGET = "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher"


# -- HTTP process -----------------------------------------------------------------------------------

def register_communicator() -> None:
    """Before the TokenizerManager exists (launcher process): ``tm.sgl_sparse_prune_communicator``."""
    from sglang.srt.managers import tokenizer_control_mixin as mixin

    if not any(spec[0] == "sgl_sparse_prune" for spec in mixin._COMMUNICATOR_SPECS):
        mixin._COMMUNICATOR_SPECS.append(("sgl_sparse_prune", SparsePruneReqOutput))


def _error(status: int, message: str, field: str | None = None) -> Any:
    from fastapi.responses import ORJSONResponse

    return ORJSONResponse({"object": "error", "message": message, "type": "BadRequestError" if status == 400 else
                           "NotFoundError", "param": field, "code": status}, status_code=status)


class _Api:
    def __init__(self) -> None:
        self.results: OrderedDict[str, dict[str, Any]] = OrderedDict()

    @staticmethod
    def _tm() -> Any:
        from sglang.srt.entrypoints.http_server import get_global_state

        return get_global_state().tokenizer_manager

    def _parse(self, tm: Any, body: Any, need_ranges: bool) -> dict[str, Any]:
        from sgl_sparse.integration import handoff

        tok = tm.tokenizer

        def render(messages: list[Any]) -> list[int]:
            ids = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=False)
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

        return parse_body(body, lambda text: tok.encode(text), render, tm.model_config.vocab_size,
                          handoff.resolver().resolve, need_ranges, int(tm.server_args.page_size or 1))

    async def _send(self, tm: Any, op: str, parsed: dict[str, Any]) -> dict[str, Any]:
        tm.auto_create_handle_loop()
        outs = await tm.sgl_sparse_prune_communicator(SparsePruneReqInput(op=op, body=json.dumps(parsed)))
        return merge([json.loads(o.result) for o in outs])

    async def _json(self, request: Request) -> Any:
        try:
            return await request.json()
        except Exception:
            raise BadPruneRequest("body", "expected a JSON object") from None

    async def prune(self, request: Request) -> Any:
        tm = self._tm()
        try:
            parsed = self._parse(tm, await self._json(request), need_ranges=True)
        except BadPruneRequest as e:
            return _error(400, str(e), e.field)
        prune_id = f"prune-{uuid.uuid4().hex[:16]}"
        if not parsed["ranges"]:
            result: dict[str, Any] = {"status": "completed", "message": "no range selected", "pruned_tokens": 0,
                                      "kept_tokens": 0, "freed_slots": 0}
        elif parsed["policy"] in BY_REQUEST and parsed["keep_tokens"] > 0:
            try:
                result = await self._request_prune(tm, parsed)
            except BadPruneRequest as e:
                return _error(400, str(e), e.field)
        else:
            result = await self._send(tm, PRUNE, parsed)
        result = {"prune_id": prune_id, "ranges": [list(r) for r in parsed.get("ranges", [])], **result}
        self.results[prune_id] = result
        while len(self.results) > _RESULTS_KEPT:
            self.results.popitem(last=False)
        from fastapi.responses import ORJSONResponse

        return ORJSONResponse(result, status_code=202)

    async def _request_prune(self, tm: Any, parsed: dict[str, Any]) -> dict[str, Any]:
        """``snapkv_global`` / ``kvzip_global`` on the route: their scores need a forward pass (the sequence's last
        queries; KVzip's reconstruction of the ranges). So the route sends the sequence as an internal request
        (greedy, one output token, whose KV is never stored) that asks to prune its own prompt
        (``custom_params['sgl_sparse_prune']``, the per-request form). For snapkv_global its prefix match stops
        ``SNAPKV_WINDOW`` tokens short (input logprobs from there: SGLang's own rule), so those tokens are
        re-forwarded and their queries score the ranges; for kvzip_global the one token SGLang always re-forwards
        completes the prompt, and that step's replays score them. At its finish the tree stores the sequence with
        the pruned positions hidden (a Chain Cache record, copy-on-write as every prune). The outcome is read off the
        tree before and after (``inspect``): what the request hid, and the slots the sequence's path gave back."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        from sgl_sparse.integration import handoff
        from sgl_sparse.prune.spec import PruneSpec
        from sgl_sparse.request_methods import PRUNE_KEY, prune_problem

        ids, ranges, keep = parsed["token_ids"], [tuple(r) for r in parsed["ranges"]], parsed["keep_tokens"]
        policy = parsed["policy"]
        if int(getattr(tm.server_args, "dp_size", 1) or 1) > 1:
            # The request would go where SGLang's DP balancing sends it, not to the rank whose tree holds the sequence.
            raise BadPruneRequest("policy", f"'{policy}' runs as a request on the rank that holds the "
                                            "sequence, which this route cannot choose under --dp-size > 1: prune "
                                            "with knorm here, or as the next request's own prune "
                                            "(custom_params['sgl_sparse_prune'])")
        resolver = handoff.resolver()
        why = prune_problem(resolver, PruneSpec(tuple(ranges), keep, policy))
        if why is not None:
            raise BadPruneRequest("policy", f"'{policy}' is served through a request that prunes its own "
                                            f"prompt, which this server cannot run: {why}")
        method = {k: parsed[k] for k in (METHOD_KEY, CONFIG_KEY) if k in parsed}
        served = resolver.resolve(method)
        if served.method.evicts:
            # The internal request runs under the namespace's method, which would evict past the ranges on its own.
            raise BadPruneRequest("policy", f"'{policy}' runs a request under the sequence's method, and "
                                            f"{served.method.name} evicts on its own: prune in that conversation's "
                                            "next request (custom_params['sgl_sparse_prune']), or with knorm here")
        none = {"pruned_tokens": 0, "kept_tokens": 0, "freed_slots": 0}
        before = await self._send(tm, INSPECT, parsed)
        if before.get("status") == "failed":
            return {**before, **none}
        end = max(hi for _, hi in ranges)
        matched = before.get("matched_tokens", 0)
        if matched < end:
            return {"status": "failed", "message": f"the tree serves only the first {matched} of these tokens (never "
                                                   "cached, evicted, or hidden by an earlier record): nothing to prune",
                    "matched_tokens": matched, **none}
        if before.get("hidden_tokens", 0):
            # The request's match would stop short of the record that hides them (32 tokens before its end), and it
            # would store its own record without them: the earlier prune or eviction would come undone.
            return {"status": "failed", "message": f"the sequence already hides {before['hidden_tokens']} positions "
                                                   f"(an earlier prune or eviction): '{policy}' prunes a "
                                                   "sequence with none; prune it with knorm or drop, or in the "
                                                   "conversation's next request", "matched_tokens": matched, **none}
        busy = [n["start"] for n in before.get("nodes", []) if n["in_use"] and n["start"] < end]
        if busy:
            return {"status": "blocked", "message": f"a running request holds this prefix (at position {busy[0]}); "
                                                    "retry when it has finished", "matched_tokens": matched, **none}
        prune = {"ranges": [list(r) for r in ranges], "keep_tokens": keep, "policy": policy,
                 "evict_branches": bool(parsed.get("evict_branches", False))}
        window = {"return_logprob": True, "logprob_start_len": max(len(ids) - SNAPKV_WINDOW, 0)} \
            if policy == SNAPKV_GLOBAL else {}
        obj = GenerateReqInput(
            input_ids=list(ids), **window,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                             "custom_params": {**method, PRUNE_KEY: json.dumps(prune)}})
        try:
            out = await tm.generate_request(obj, None).__anext__()
        except Exception as e:  # refused (ValueError) or failed in the scheduler (HTTPException): reported
            return {"status": "failed", "message": f"the pruning request failed: {type(e).__name__}: {e}",
                    "matched_tokens": matched, **none}
        reason = ((out or {}).get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return {"status": "failed", "message": f"the pruning request was aborted: {reason.get('message', '')}",
                    "matched_tokens": matched, **none}
        report = (((out or {}).get("meta_info") or {}).get("sgl_sparse") or {}).get("prune") or {}
        if report.get("status") == "unscored":
            return {"status": "failed", "message": f"the pruning request could not score: {report.get('message')}",
                    "matched_tokens": matched, **none}
        after = await self._send(tm, INSPECT, parsed)
        if after.get("matched_tokens", 0) < end:
            return {"status": "failed", "message": "the pruned sequence is no longer cached (evicted meanwhile)",
                    "matched_tokens": after.get("matched_tokens", 0), **none}
        counts = route_counts(before, after, ranges)
        if counts["kept_tokens"] >= counts["pruned_tokens"]:
            # keep_tokens < the ranges' size (parse_keep), so a prune that ran hid some: this one did not run.
            return {"status": "failed", "message": "the pruning request finished without pruning (its prune could "
                                                   "not score: see the server log and unscored_prunes_total in "
                                                   "/server_info)", "matched_tokens": counts["matched_tokens"], **none}
        extra = {"window_tokens": min(SNAPKV_WINDOW, len(ids))} if policy == SNAPKV_GLOBAL else {}
        return {"status": "completed", "policy": policy, **extra, **counts}

    async def status(self, prune_id: str) -> Any:
        result = self.results.get(prune_id)
        if result is None:
            return _error(404, f"no prune {prune_id!r} (unknown, or older than the last {_RESULTS_KEPT})", "prune_id")
        return result

    async def inspect(self, request: Request) -> Any:
        tm = self._tm()
        try:
            parsed = self._parse(tm, await self._json(request), need_ranges=False)
        except BadPruneRequest as e:
            return _error(400, str(e), e.field)
        result = await self._send(tm, INSPECT, parsed)
        return {"tokens": len(parsed["token_ids"]), **result}

    async def match(self, request: Request) -> Any:
        result = await self.inspect(request)
        if not isinstance(result, dict):
            return result
        return {k: result[k] for k in ("tokens", "matched_tokens", "resident_tokens", "hidden_tokens") if k in result}


# -- per request: the chat-role form of custom_params sgl_sparse_prune (OpenAI chat route) -------------------

def after_convert_chat_request(result: Any, serving: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``OpenAIServingChat._convert_to_internal_request``: ``custom_params["sgl_sparse_prune"]`` given as
    ``{"roles": [...], "lag": n}`` becomes ``{"ranges": ...}`` over this request's rendered prompt (the messages
    exist only here); the generate-request validation then checks it as any ranges. A ValueError here is the
    route's HTTP 400."""
    from sgl_sparse.integration import BACKEND_NAME
    from sgl_sparse.request_methods import PRUNE_FIELDS, PRUNE_KEY

    tm = serving.tokenizer_manager
    adapted, request = result
    sp = adapted.sampling_params if isinstance(adapted.sampling_params, dict) else None
    cp = sp.get("custom_params") if sp is not None else None
    if tm.server_args.radix_cache_backend != BACKEND_NAME or not isinstance(cp, dict) or PRUNE_KEY not in cp:
        return result
    try:
        spec = json.loads(cp[PRUNE_KEY]) if isinstance(cp[PRUNE_KEY], str) else cp[PRUNE_KEY]
    except json.JSONDecodeError:
        return result  # the validation names the key and the JSON error
    if not isinstance(spec, Mapping) or "roles" not in spec:
        return result
    where = f"custom_params[{PRUNE_KEY!r}]"
    keep_fields = PRUNE_FIELDS - {"ranges", "evict_branches"}
    unknown = sorted(set(spec) - {"roles", "lag", "evict_branches"} - keep_fields)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; the chat form is {{\"roles\": [...], \"lag\": n}}, "
                         "optionally with keep_tokens or keep_ratio and policy, and evict_branches")
    if not isinstance(adapted.input_ids, list) or not adapted.input_ids or isinstance(adapted.input_ids[0], list):
        raise ValueError(f"{where}: roles need the route's rendered token ids (a text-only chat template): give "
                         "ranges")
    tok = tm.tokenizer

    def render(messages: list[Any]) -> list[int]:
        ids = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=False)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    messages = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in request.messages]
    try:
        ranges = chat_ranges(render, messages, adapted.input_ids, spec.get("roles"), spec.get("lag", 0))
    except BadPruneRequest as e:
        raise ValueError(f"{where}: {e}") from None
    keep = {k: v for k, v in spec.items() if k in keep_fields}
    try:  # the keep fields and evict_branches whatever the ranges (their size is checked below)
        parse_evict_branches(spec)
        keep_tokens, _ = parse_keep(keep, 0, 1, REQUEST_POLICIES, REQUEST_SCORED)
    except KeepError as e:
        raise ValueError(f"{where}: {e.field}: {e}") from None
    size = sum(hi - lo for lo, hi in ranges)
    if ranges and keep_tokens < size:
        evict = {"evict_branches": spec["evict_branches"]} if "evict_branches" in spec else {}
        cp[PRUNE_KEY] = json.dumps({"ranges": ranges, **keep, **evict})
    else:
        # Nothing older than the lag, or a keep_tokens that covers every token the roles select (the client cannot
        # know their size): nothing to prune, the request is an ordinary one.
        del cp[PRUNE_KEY]
    return result


CHAT_CONVERT_TARGET = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request"


def install_routes(app: Any) -> None:
    """Our routes on SGLang's FastAPI app (launcher process, before ``run_server``)."""
    api = _Api()
    app.add_api_route("/v1/prefix_cache/prune", api.prune, methods=["POST"])
    app.add_api_route("/v1/prefix_cache/prune/{prune_id}", api.status, methods=["GET"])
    app.add_api_route("/v1/prefix_cache/inspect", api.inspect, methods=["POST"])
    app.add_api_route("/v1/prefix_cache/match", api.match, methods=["POST"])
