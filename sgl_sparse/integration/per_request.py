"""Per-request methods in the server (sgl_sparse/request_methods.py holds the rules).

* HTTP process: :func:`.handoff.resolver` (built once from the launcher's hand-off) validates each request's
  ``custom_params`` (through :mod:`.validation`, so a bad choice is HTTP 400 before it reaches the
  scheduler) and :func:`around_wait_one_response` reports the serving method in ``meta_info["sgl_sparse"]``
  of every response (``/generate``; :func:`after_build_openai_response` copies it into a non-streaming OpenAI
  response's ``metadata``), with the outcome of the request's own prune (``custom_params`` ``sgl_sparse_prune``)
  under ``"prune"``;
* scheduler: :func:`before_add_request_to_queue` makes the request's record (sgl_sparse/request.py) when it
  first enters the waiting queue: its method, its own prune, its namespace in the prefix tree
  (``SparseRuntime.admit``), so every match, including the waiting queue's prefix-aware ordering, already sees
  the request's own namespace.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sgl_sparse.integration import BACKEND_NAME, handoff
from sgl_sparse.request import PRUNE_REPORT


def _custom_params(obj: Any) -> Any:
    sp = getattr(obj, "sampling_params", None)
    return sp.get("custom_params") if isinstance(sp, dict) else None


def around_wait_one_response(original: Any, tm: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager._wait_one_response(self, obj, request)``, an async generator of one
    request's outputs: each output's ``meta_info`` gains the method that served it."""
    gen = original(tm, obj, *args, **kwargs)
    from sglang.srt.managers.io_struct import GenerateReqInput

    if tm.server_args.radix_cache_backend != BACKEND_NAME or not isinstance(obj, GenerateReqInput):
        return gen
    # Validated before the request was sent (validation.py), so this cannot fail here.
    info = handoff.resolver().resolve(_custom_params(obj)).describe()

    async def with_method() -> AsyncIterator[Any]:
        prune = None
        async for out in gen:
            meta = out.get("meta_info") if isinstance(out, dict) else None
            if isinstance(meta, dict):
                # Every request of a batch that carried a report gets the key (None per token): drop it; keep the
                # report itself for every later chunk (incremental streaming slices it off after the first).
                reports = meta.pop(PRUNE_REPORT, None) or []
                prune = next((r for r in reports if isinstance(r, dict)), prune)
                meta["sgl_sparse"] = info if prune is None else {**info, "prune": prune}
            yield out

    return with_method()


def after_build_openai_response(result: Any, serving: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``OpenAIServingChat._build_chat_response(self, request, ret, created)`` and
    ``OpenAIServingCompletion._build_completion_response`` (the same arguments): the first output's
    ``meta_info["sgl_sparse"]`` (the method, and the request's own prune report) goes into the response's
    ``metadata``, SGLang's response-level field beside its ``weight_version`` (taken from the first output too), so
    an OpenAI client sees it. Non-streaming responses only: SGLang's stream chunks carry no ``metadata``."""
    ret = kwargs.get("ret", args[1] if len(args) > 1 else None)
    meta = ret[0].get("meta_info") if isinstance(ret, list) and ret and isinstance(ret[0], dict) else None
    info = meta.get("sgl_sparse") if isinstance(meta, dict) else None
    if info is None or not hasattr(result, "metadata"):  # not our server's, or an error response
        return result
    result.metadata = {**(result.metadata or {}), "sgl_sparse": info}
    return result


def before_add_request_to_queue(scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``Scheduler._add_request_to_queue(self, req, is_retracted=False)``."""
    from sgl_sparse.integration.runtime import get_runtime

    rt = get_runtime()
    if rt.serving:
        rt.admit(req)


WAIT_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._wait_one_response"
ADMIT_TARGET = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
OPENAI_RESPONSE_TARGETS = (
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._build_chat_response",
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._build_completion_response",
)
