"""Launcher -> scheduler hand-off of the method config.

SGLang spawns its scheduler processes (``mp.set_start_method("spawn")``), so module state of the
launcher is lost, but the environment is inherited. The launcher validates the config and stores
it, normalised, in one environment variable; each scheduler process reads it back when it builds
our tree and attention backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_sparse.request_methods import MethodResolver

# Not "SGL_*": SGLang 0.5.17 treats that prefix as a deprecated alias of "SGLANG_*" and warns.
ENV_VAR = "SGLSPARSE_CONFIG"


@dataclass(frozen=True)
class Handoff:
    method: str
    config: dict[str, Any]
    device: str | None  # the server's --device, None when unknown (plain `sglang serve`)
    # The stock backend our attention backend wraps ("flashinfer", "triton", "torch_native"); None when
    # unknown (plain `sglang serve`), so the backend picks by device.
    base: str | None = None
    # Why the launcher turned SGLang's prefill CUDA graph off, for /server_info; None when the prefill
    # graph setting is SGLang's own (its default or the user's flags).
    prefill_cuda_graph_off: str | None = None
    # --sparse-request-methods as resolved ("off" or "eviction"): what a request may choose
    # (sgl_sparse/request_methods.py).
    request_methods: str = "off"
    # --sparse-request-decode-window as resolved: the decode queries a method chosen per request may observe.
    request_decode_window: int = 0
    # Why a request's own prune cannot keep a scored part of its ranges here (keep_tokens / keep_ratio: the scores
    # read the prompt's last queries and the pool's keys); None when it can.
    scored_prune_problem: str | None = None
    # Why a request's own prune cannot keep with policy kvzip_global here (its replay forwards); None when it can,
    # and then replay_prompts holds kvzip's instructions tokenized (prompt_ids, next_prompt_ids, postfix_ids).
    replay_prune_problem: str | None = "the launcher did not set it up"
    replay_prompts: dict[str, list[int]] | None = None

    def dump(self) -> str:
        return json.dumps({"method": self.method, "config": self.config, "device": self.device, "base": self.base,
                           "prefill_cuda_graph_off": self.prefill_cuda_graph_off,
                           "request_methods": self.request_methods,
                           "request_decode_window": self.request_decode_window,
                           "scored_prune_problem": self.scored_prune_problem,
                           "replay_prune_problem": self.replay_prune_problem, "replay_prompts": self.replay_prompts})


def publish(handoff: Handoff) -> None:
    os.environ[ENV_VAR] = handoff.dump()


def read() -> Handoff:
    """The launcher's choice; ``dense`` with defaults if the server was started without our launcher
    (e.g. ``sglang serve --radix-cache-backend sgl_sparse``)."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return Handoff(method="dense", config={}, device=None)
    data = json.loads(raw)
    replay_problem = data.get("replay_prune_problem", Handoff.replay_prune_problem)
    if replay_problem is None and data.get("replay_prompts") is None:
        replay_problem = "the launcher did not tokenize KVzip's instructions"  # the two must agree
    return Handoff(method=data["method"], config=data.get("config") or {}, device=data.get("device"),
                   base=data.get("base"), prefill_cuda_graph_off=data.get("prefill_cuda_graph_off"),
                   request_methods=data.get("request_methods", "off"),
                   request_decode_window=int(data.get("request_decode_window", 0)),
                   scored_prune_problem=data.get("scored_prune_problem"),
                   replay_prune_problem=replay_problem,
                   replay_prompts=data.get("replay_prompts"))


_resolver: MethodResolver | None = None


def resolver() -> MethodResolver:
    """This process's :class:`~sgl_sparse.request_methods.MethodResolver` (built once, from :func:`read`): the
    server's method and what a request may choose. The HTTP process validates requests with it, the scheduler
    admits them with it."""
    global _resolver
    if _resolver is None:
        from sgl_sparse.registry import create_method
        from sgl_sparse.request_methods import MethodResolver

        h = read()
        _resolver = MethodResolver(create_method(h.method, h.config), h.request_methods, h.scored_prune_problem,
                                   h.replay_prune_problem, h.request_decode_window)
    return _resolver
