"""Replay a trace against a running server, as the sessions' clients would, and record what users feel.

Two clients:

* ``openai``: ``/v1/chat/completions`` with the full message history each turn, streamed (TTFT and
  time per output token come from the stream), ``max_tokens`` = the recorded output length,
  ``ignore_eos``. Tool results are messages of role ``tool``.
* ``frontend``: one SGLang frontend-language program per session (``@sgl.function`` through
  ``sgl.RuntimeEndpoint``) that appends each tool result (as a user message wrapped in
  ``<tool_result>`` tags: the frontend has no tool role) and ``sgl.gen``s each turn. The frontend
  does not stream, so its turns have latency but no TTFT.

Session state follows the server's real responses: each assistant message is the text the server
returned. Sessions start at their arrival time and wait ``wait_s`` between turns (tool execution).

Pruning mode (``prune_lag``, OpenAI client only): after each turn the session asks the server to prune its
own tool results but the ``prune_lag`` most recent (``POST /v1/prefix_cache/prune`` with the turn's messages,
``roles`` and ``lag``: docs/prefix-cache-pruning.md), while the tool runs, before its next turn; each prune is
recorded (:class:`PruneRecord`), and the next turn's ``cached_tokens`` shows whether it still hit the cache.
With ``prune_policy="snapkv_global"`` (or ``"kvzip_global"``) the prune travels instead in the turn's own request
(``custom_params`` ``sgl_sparse_prune`` with ``roles``, ``lag``, ``keep_ratio`` and the policy): the request keeps the
fraction of the old tool tokens its policy scores highest and prunes the rest after its prefill (recorded with
status ``in_request``; the route's answer fields stay 0).
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests

from bench_agent.text import TextSource
from bench_agent.workload import Session, Trace

# Policies only a request's own prune serves (its prompt's last queries score the ranges): pruning mode then sends
# the prune with the turn's request instead of POST /v1/prefix_cache/prune after it.
REQUEST_ONLY_POLICIES = ("snapkv_global", "kvzip_global")
PRUNE_POLICIES = ("knorm", *REQUEST_ONLY_POLICIES)


@dataclass
class TurnRecord:
    session: str
    turn: int
    start_s: float  # since the run's start
    end_s: float
    ttft_s: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None


@dataclass
class PruneRecord:
    session: str
    turn: int  # the turn whose prompt was pruned (the next turn continues it)
    start_s: float
    end_s: float
    status: str  # completed | blocked | failed | error (HTTP or connection) | in_request (the turn's own prune)
    ranges: int = 0
    pruned_tokens: int = 0
    freed_slots: int = 0
    message: str = ""
    evicted_branch_slots: int = 0  # KV of the session's stale reply branches evicted first (``evict_branches``)
    kept_tokens: int = 0  # of the ranges, kept by the scored keep (``--prune-keep-ratio``)


@dataclass
class RunResult:
    label: str
    client: str
    wall_s: float = 0.0
    turns: list[TurnRecord] = field(default_factory=list)
    session_end_s: dict[str, float] = field(default_factory=dict)
    kv_samples: list[tuple[float, int]] = field(default_factory=list)  # (t, KV slots in use)
    kv_capacity: int = 0
    errors: list[str] = field(default_factory=list)
    prunes: list[PruneRecord] = field(default_factory=list)
    prune_lag: int | None = None
    prune_keep_ratio: float = 0.0
    prune_policy: str = "knorm"


def kv_slots_in_use(base_url: str) -> tuple[int, int] | None:
    """(used, capacity) KV slots from ``/v1/loads``: ``num_used_tokens`` is what SGLang logs as
    ``#token`` (slots held by requests, outside the evictable prefix tree), physical on both servers."""
    try:
        info = requests.get(f"{base_url}/v1/loads", timeout=5).json()
    except (requests.RequestException, ValueError):
        return None
    loads = info.get("loads", info) if isinstance(info, dict) else info
    if isinstance(loads, list) and loads:
        first = loads[0]
        core = first.get("core", first)
        used, total = core.get("num_used_tokens"), core.get("max_total_num_tokens")
        if used is not None and total:
            return int(used), int(total)
    return None


class KVMonitor(threading.Thread):
    def __init__(self, base_url: str, t0: float, result: RunResult, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.base_url, self.t0, self.result, self.interval_s = base_url, t0, result, interval_s
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            got = kv_slots_in_use(self.base_url)
            if got is not None:
                self.result.kv_samples.append((time.monotonic() - self.t0, got[0]))
                self.result.kv_capacity = got[1]
            self.stop_event.wait(self.interval_s)


class _Materialiser:
    """Texts of one session, deterministic from the session's seed."""

    def __init__(self, source: TextSource, session: Session) -> None:
        rng = random.Random(session.text_seed)
        self.system = source.text(session.system_tokens, rng)
        self.task = source.text(session.task_tokens, rng)
        self.tools = [source.text(t.tool_tokens, rng) for t in session.turns]


def _openai_turn(base_url: str, model: str, messages: list[dict], max_tokens: int, timeout: float,
                 custom_params: dict[str, Any] | None = None) -> tuple[str, float | None, dict]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if custom_params:
        body["custom_params"] = custom_params
    t0 = time.monotonic()
    ttft, text, usage = None, [], {}
    with requests.post(f"{base_url}/v1/chat/completions", json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                if ttft is None:
                    ttft = time.monotonic() - t0
                text.append(choices[0]["delta"]["content"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return "".join(text), ttft, usage


def _prune_turn(base_url: str, session: Session, turn: int, messages: list[dict], roles: list[str], lag: int,
                t0: float, result: RunResult, keep_ratio: float = 0.0) -> None:
    """Prune the finished turn's prompt (``messages``, as sent): the tree holds it rendered with the generation
    prompt, followed by the reply, and the prune selector renders it without, a prefix of that sequence."""
    start = time.monotonic()
    # evict_branches: the previous reply as generated is a branch of its own beside the re-rendered history
    # whenever the two differ; it alone would keep the pruned tool results' KV (docs/prefix-cache-pruning.md).
    body: dict[str, Any] = {"messages": messages, "roles": roles, "lag": lag, "evict_branches": True}
    if keep_ratio:
        body["keep_ratio"] = keep_ratio  # the server takes it over the ranges it finds, in whole pages
    try:
        r = requests.post(f"{base_url}/v1/prefix_cache/prune", json=body, timeout=60)
        res = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != 202:
            rec = PruneRecord(session.id, turn, start - t0, time.monotonic() - t0, "error",
                              message=f"HTTP {r.status_code}: {str(res.get('message', r.text))[:200]}")
        else:
            rec = PruneRecord(session.id, turn, start - t0, time.monotonic() - t0, str(res.get("status")),
                              len(res.get("ranges") or []), int(res.get("pruned_tokens") or 0),
                              int(res.get("freed_slots") or 0), str(res.get("message") or ""),
                              int(res.get("evicted_branch_slots") or 0), int(res.get("kept_tokens") or 0))
    except (requests.RequestException, ValueError) as e:
        rec = PruneRecord(session.id, turn, start - t0, time.monotonic() - t0, "error", message=str(e)[:200])
    result.prunes.append(rec)
    if rec.status == "error":
        result.errors.append(f"{session.id} prune after turn {turn}: {rec.message}")


def _run_openai_session(base_url: str, model: str, session: Session, texts: _Materialiser, t0: float,
                        result: RunResult, timeout: float, time_scale: float, prune_lag: int | None = None,
                        prune_roles: list[str] | None = None, prune_keep_ratio: float = 0.0,
                        prune_policy: str = "knorm") -> None:
    messages = [{"role": "system", "content": texts.system}, {"role": "user", "content": texts.task}]
    roles = prune_roles or ["tool"]
    in_request = prune_lag is not None and prune_policy in REQUEST_ONLY_POLICIES
    for i, turn in enumerate(session.turns):
        start = time.monotonic()
        # The turn's own prune: its prompt holds more tool results than the lag spares.
        own = in_request and sum(m["role"] in roles for m in messages) > (prune_lag or 0)
        # evict_branches: as the route's prunes below, the earlier replies as generated would keep the pruned KV.
        cp = {"sgl_sparse_prune": json.dumps({"roles": roles, "lag": prune_lag, "keep_ratio": prune_keep_ratio,
                                              "policy": prune_policy, "evict_branches": True})} if own else None
        try:
            reply, ttft, usage = _openai_turn(base_url, model, messages, turn.output_tokens, timeout, cp)
        except Exception as e:  # noqa: BLE001 - recorded, the session stops
            result.errors.append(f"{session.id} turn {i}: {e}")
            result.turns.append(TurnRecord(session.id, i, start - t0, time.monotonic() - t0, None, 0, 0, 0, str(e)))
            return
        end = time.monotonic()
        details = usage.get("prompt_tokens_details") or {}
        result.turns.append(TurnRecord(session.id, i, start - t0, end - t0, ttft, int(usage.get("prompt_tokens", 0)),
                                       int(usage.get("completion_tokens", 0)), int(details.get("cached_tokens") or 0)))
        if own:  # pruned while this turn ran; the next turn continues the pruned prompt
            result.prunes.append(PruneRecord(session.id, i, start - t0, end - t0, "in_request"))
        # Only a turn with a later one benefits, and only once a tool result is older than the lag.
        n_tools = sum(m["role"] in roles for m in messages)
        if prune_lag is not None and not in_request and turn.tool_tokens and n_tools > prune_lag:
            # The prune runs while the tool "executes", as an agent framework would do it: off the critical path.
            p0 = time.monotonic()
            _prune_turn(base_url, session, i, list(messages), roles, prune_lag, t0, result,
                        prune_keep_ratio)
            wait_left = turn.wait_s * time_scale - (time.monotonic() - p0)
        else:
            wait_left = turn.wait_s * time_scale
        messages.append({"role": "assistant", "content": reply})
        if turn.tool_tokens:
            time.sleep(max(0.0, wait_left))
            messages.append({"role": "tool", "content": texts.tools[i]})
    result.session_end_s[session.id] = time.monotonic() - t0


def _frontend_program():  # type: ignore[no-untyped-def]
    import sglang as sgl

    @sgl.function
    def agent_session(s, system: str, task: str, turns: list[tuple[int, float, str]], clock: list):  # type: ignore[no-untyped-def]
        s += sgl.system(system)
        s += sgl.user(task)
        for i, (out_tokens, wait_s, tool_text) in enumerate(turns):
            start = time.monotonic()
            s += sgl.assistant(sgl.gen(f"out{i}", max_tokens=out_tokens, ignore_eos=True, temperature=0))
            _ = s[f"out{i}"]  # wait for this turn's output before the tool "runs"
            clock.append((start, time.monotonic()))
            if tool_text:
                time.sleep(wait_s)
                s += sgl.user("<tool_result>\n" + tool_text + "\n</tool_result>")

    return agent_session


def _run_frontend_session(backend: Any, program: Any, session: Session, texts: _Materialiser, t0: float,
                          result: RunResult, time_scale: float) -> None:
    clock: list[tuple[float, float]] = []
    turns = [(t.output_tokens, t.wait_s * time_scale, texts.tools[i]) for i, t in enumerate(session.turns)]
    state = program.run(system=texts.system, task=texts.task, turns=turns, clock=clock, backend=backend)
    try:
        state.sync()
        for i, (start, end) in enumerate(clock):
            meta = state.get_meta_info(f"out{i}")
            result.turns.append(TurnRecord(session.id, i, start - t0, end - t0, None, int(meta["prompt_tokens"]),
                                           int(meta["completion_tokens"]), int(meta.get("cached_tokens") or 0)))
    except Exception as e:  # noqa: BLE001 - recorded
        result.errors.append(f"{session.id}: {e}")
    if state.error() is not None:
        result.errors.append(f"{session.id}: {state.error()}")
    result.session_end_s[session.id] = time.monotonic() - t0


def replay(base_url: str, trace: Trace, tokenizer: Any, client: str = "openai", label: str = "",
           model: str = "default", request_timeout: float = 3600.0, time_scale: float = 1.0,
           progress: bool = True, prune_lag: int | None = None, prune_roles: list[str] | None = None,
           prune_keep_ratio: float = 0.0, prune_policy: str = "knorm") -> RunResult:
    """Replay every session of ``trace``; ``time_scale`` multiplies arrival and wait times. ``prune_lag``:
    pruning mode (module docstring), sparing that many most recent ``prune_roles`` (default ``["tool"]``)
    messages; ``prune_policy``: the scored keep's (``knorm`` through the route after each turn, ``snapkv_global``
    in the turn's own request, which needs ``prune_keep_ratio`` > 0)."""
    if client not in ("openai", "frontend"):
        raise ValueError(f"client must be 'openai' or 'frontend', got {client!r}")
    if prune_lag is not None and (client != "openai" or prune_lag < 0):
        raise ValueError("pruning mode needs the openai client (the frontend client has no tool role and sends "
                         f"text) and prune_lag >= 0; got client {client!r}, prune_lag {prune_lag}")
    if prune_policy not in PRUNE_POLICIES:
        raise ValueError(f"prune_policy {prune_policy!r}: one of {', '.join(PRUNE_POLICIES)}")
    if prune_policy in REQUEST_ONLY_POLICIES and not prune_keep_ratio:
        raise ValueError(f"prune_policy {prune_policy!r} scores what it keeps: give prune_keep_ratio > 0")
    source = TextSource(tokenizer)
    texts = {s.id: _Materialiser(source, s) for s in trace.sessions}
    result = RunResult(label=label or base_url, client=client, prune_lag=prune_lag,
                       prune_keep_ratio=prune_keep_ratio if prune_lag is not None else 0.0,
                       prune_policy=prune_policy if prune_keep_ratio else "drop")
    t0 = time.monotonic()
    monitor = KVMonitor(base_url, t0, result)
    monitor.start()
    backend = program = None
    if client == "frontend":
        import sglang as sgl

        backend, program = sgl.RuntimeEndpoint(base_url), _frontend_program()
    bar = _progress(len(trace.sessions)) if progress else None

    def run(session: Session) -> None:
        delay = session.arrival_s * time_scale - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        if client == "openai":
            _run_openai_session(base_url, model, session, texts[session.id], t0, result, request_timeout, time_scale,
                                prune_lag, prune_roles, prune_keep_ratio, prune_policy)
        else:
            _run_frontend_session(backend, program, session, texts[session.id], t0, result, time_scale)
        if bar is not None:
            bar.update(1)

    with ThreadPoolExecutor(max(1, len(trace.sessions))) as pool:
        list(pool.map(run, trace.sessions))
    result.wall_s = time.monotonic() - t0
    monitor.stop_event.set()
    monitor.join(timeout=5)
    if bar is not None:
        bar.close()
    result.turns.sort(key=lambda r: (r.session, r.turn))
    result.prunes.sort(key=lambda r: (r.session, r.turn))
    return result


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="sessions", unit="session")
