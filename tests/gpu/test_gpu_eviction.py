"""Eviction on the GPU (quality-large, bf16, FlashInfer base): CUDA graphs on vs off give the same greedy
tokens while SnapKV / StreamingLLM really evict; a randomized multi-turn stress with aborts leaves no leak
under SGLang's strict idle check; and one conversation's eviction never changes another's output
(contamination through a shared prompt). Five servers, started together.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from gpu_common import (
    CONTEXT,
    assert_alive,
    assert_idle_and_sound,
    assert_same_tokens,
    decode,
    decode_lines,
    encode,
    flush_and_check_empty,
    generate,
    log_mark,
    log_since,
    ours,
    prose,
    state,
)

from sgl_sparse.quality.tasks import KEY_WORDS, haystack_sentences
from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu

METHODS = {  # budgets well below the 4-8K prompts: both evict at prefill end, StreamingLLM during decode too
    "snapkv": {"budget": 1024, "window_size": 32, "sink_tokens": 64, "kernel_size": 5, "decode_interval": 0},
    "streamingllm": {"sink_tokens": 64, "recent_tokens": 256, "evict_interval": 32},
}
SMALL_SNAPKV = {"budget": 256, "window_size": 32, "sink_tokens": 32}
EAGER = ["--disable-cuda-graph"]
# The CUDA-graph servers raise on any host sync in our decode-step code (integration/syncs.py): a sync
# there would stall overlap scheduling, so every test on them also checks the hot path stays sync-free.
NO_SYNC = {"SGLSPARSE_SYNC_DEBUG": "error"}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs: dict[str, ServerProcess] = {}
    for m, cfg in METHODS.items():
        procs[f"{m}:graph"] = ours(f"evict-{m}-graph", m, cfg, env=NO_SYNC)
        procs[f"{m}:eager"] = ours(f"evict-{m}-eager", m, cfg, EAGER)
    procs["snapkv256"] = ours("evict-snapkv256", "snapkv", SMALL_SNAPKV, env=NO_SYNC)
    with running(*procs.values()):
        yield procs


# -- 3. CUDA graphs on vs off ------------------------------------------------------------------------------
GRAPH_CASES = {3: [4500, 6100, 7900], 5: [4096, 5000, 6000, 7000, 8000]}  # decode graphs of 4 and 8: padding
GRAPH_OUT = 160  # StreamingLLM evicts every 32 decoded tokens: 5 decode-time compactions under the graph


@pytest.mark.parametrize("batch", list(GRAPH_CASES))
@pytest.mark.parametrize("method", list(METHODS))
def test_cuda_graphs_on_and_off_give_the_same_tokens(servers: dict[str, ServerProcess], method: str,
                                                     batch: int) -> None:
    lens = GRAPH_CASES[batch]
    prompts = [prose(1000 * batch + i, n) for i, n in enumerate(lens)]
    runs: dict[str, Any] = {}
    for mode in ("graph", "eager"):
        srv = servers[f"{method}:{mode}"]
        before, mark = state(srv), log_mark(srv)
        outs = generate(srv, prompts, GRAPH_OUT)
        after = state(srv)
        runs[mode] = {"outs": outs, "evicted": after["evicted_tokens_total"] - before["evicted_tokens_total"],
                      "lines": decode_lines(log_since(srv, mark))}
    name = f"{method} {METHODS[method]}"
    g, e = runs["graph"], runs["eager"]
    assert g["evicted"] > 0 and e["evicted"] > 0, (
        f"{name}: nothing was evicted (graph {g['evicted']}, eager {e['evicted']})")
    assert_same_tokens(e["outs"], g["outs"], "CUDA graphs off", "CUDA graphs on",
                       f"{name}, {batch} concurrent requests", [f"{n}-token prompt" for n in lens])
    assert g["evicted"] == e["evicted"], (
        f"{name}, batch {batch}: CUDA graphs on evicted {g['evicted']} tokens, off {e['evicted']}")
    full = [graph for n, graph in g["lines"] if n == batch]
    assert full and all(full), (
        f"{name}: expected the graph server's decode at batch {batch} to replay CUDA graphs (padded), log lines "
        f"(#running-req, cuda graph): {g['lines']}")
    assert not any(graph for _, graph in e["lines"]), f"{name}: the --disable-cuda-graph server logged graph decode"


# -- 4. randomized multi-turn stress with aborts -----------------------------------------------------------
STRESS_CONVERSATIONS = 6
STRESS_MAX_LOGICAL = 12_000
START_TOKENS = (500, 3000)  # first prompts
ABORT_PREFILL_SUFFIX = (5000, 8000)  # new tokens of a turn aborted in prefill: 3-4 chunks of 2,048
LONG_OUT = 4000  # generations meant to be aborted mid-decode (~10 s if an abort never came)
# The second turn of conversation i is FORCED[i], so every run has each kind of abort; later turns are random.
FORCED = ["abort_prefill", "close_stream", "abort_decode", "abort_prefill", "normal", "abort_prefill"]


def _post(server: ServerProcess, ids: list[int], max_new: int, rid: str | None = None) -> requests.Response:
    body: dict[str, Any] = {"input_ids": ids,
                            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    if rid:
        body["rid"] = rid
    return requests.post(f"{server.base_url}/generate", json=body, timeout=300)


def _abort_later(server: ServerProcess, rid: str, delay: float) -> None:
    time.sleep(delay)
    requests.post(f"{server.base_url}/abort_request", json={"rid": rid}, timeout=30)


def _stream_and_close(server: ServerProcess, ids: list[int], max_new: int, after_chunks: int) -> int:
    """Stream a long generation and drop the connection after ``after_chunks`` chunks: SGLang aborts the
    request when its stream ends. Returns the chunks read."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    n = 0
    with requests.post(f"{server.base_url}/generate", json=body, timeout=300, stream=True) as r:
        assert r.status_code == 200, r.text[:500]
        for line in r.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                n += 1
                if n >= after_chunks:
                    break
    return n


def _prefill_seconds(server: ServerProcess, n_tokens: int) -> float:
    """Wall time of one fresh ``n_tokens`` prefill (one output token) on the idle server."""
    t0 = time.monotonic()
    r = _post(server, prose(77_777, n_tokens), 1)
    assert r.status_code == 200, r.text[:500]
    return time.monotonic() - t0


class _Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.problems: list[str] = []

    def count(self, what: str) -> None:
        with self.lock:
            self.outcomes[what] += 1

    def problem(self, what: str) -> None:
        with self.lock:
            self.problems.append(what)


def _conversation(server: ServerProcess, cid: int, seed: int, prefill_s: float, log: _Log) -> int:
    """Turns of one conversation (each prompt = the previous prompt + its output + new text); returns how many
    turns had to be Chain Cache hits."""
    rng = random.Random(seed)
    history = prose(seed, rng.randrange(*START_TOKENS))
    prev_len: int | None = None  # logical tokens the tree holds for this conversation after a finished turn
    expected_hits = 0
    for turn in range(rng.randrange(3, 7)):
        if len(history) > STRESS_MAX_LOGICAL:
            break
        kind = FORCED[cid % len(FORCED)] if turn == 1 else rng.choices(
            ["normal", "abort_prefill", "abort_decode", "close_stream"], weights=[5, 2, 1, 2])[0]
        if kind == "abort_prefill" and len(history) + ABORT_PREFILL_SUFFIX[1] + 64 > CONTEXT - 256:
            kind = "normal"
        where = f"conversation {cid} turn {turn} ({kind}, prompt {len(history)} tokens)"
        if kind == "normal":
            n_out = rng.randrange(16, 129)
            r = _post(server, history, n_out)
            assert r.status_code == 200, f"{where}: HTTP {r.status_code} {r.text[:500]}"
            out = r.json()
            meta = out["meta_info"]
            if meta["completion_tokens"] != n_out:
                log.problem(f"{where}: {meta['completion_tokens']} of {n_out} tokens")
            if prev_len is not None:
                expected_hits += 1
                if meta["cached_tokens"] < prev_len - 1:  # the whole previous turn (less its last token at most)
                    log.problem(f"{where}: Chain Cache matched {meta['cached_tokens']} of the previous turn's "
                                f"{prev_len} tokens")
            log.count("finished")
            prev_len = len(history) + len(out["output_ids"])
            history = history + out["output_ids"] + prose(seed * 100 + turn, rng.randrange(20, 400))
            continue
        if kind in ("abort_prefill", "abort_decode"):
            if kind == "abort_prefill":
                # A long new suffix: several prefill chunks. The abort comes at 10-50% of an idle server's time
                # for such a prefill (under this load prefill is slower), after the rid is known.
                history = history + prose(seed * 100 + turn, rng.randrange(*ABORT_PREFILL_SUFFIX))
                n_out, delay = 64, 0.005 + prefill_s * rng.uniform(0.1, 0.5)
            else:
                n_out, delay = min(LONG_OUT, CONTEXT - len(history) - 64), rng.uniform(0.2, 0.6)
            rid = f"stress-{server.port}-{cid}-{turn}"
            t = threading.Thread(target=_abort_later, args=(server, rid, delay))
            t.start()
            r = _post(server, history, n_out, rid)
            t.join()
            assert r.status_code in (200, 400), f"{where}: HTTP {r.status_code} {r.text[:500]}"
            meta = r.json().get("meta_info", {}) if r.status_code == 200 else {}
            aborted = r.status_code == 400 or (meta.get("finish_reason") or {}).get("type") == "abort"
            tokens = meta.get("completion_tokens", 0)
            log.count("finished before the abort" if not aborted else
                      "aborted before the first token" if tokens == 0 else "aborted mid-decode")
        else:
            _stream_and_close(server, history, min(LONG_OUT, CONTEXT - len(history) - 64), rng.randrange(5, 80))
            log.count("stream closed mid-decode")
        prev_len = None  # the next prompt leaves this turn's (partial) output out: not its continuation
        history = history + prose(seed * 100 + turn + 50, rng.randrange(20, 200))
    return expected_hits


@pytest.mark.parametrize("method", list(METHODS))
def test_random_multi_turn_stress_with_aborts_does_not_leak(servers: dict[str, ServerProcess], method: str) -> None:
    server = servers[f"{method}:graph"]
    prefill_s = _prefill_seconds(server, ABORT_PREFILL_SUFFIX[0])
    base = assert_idle_and_sound(server)
    log = _Log()
    seeds = [sum(map(ord, method)) * 10 + i for i in range(STRESS_CONVERSATIONS)]
    try:
        with ThreadPoolExecutor(STRESS_CONVERSATIONS) as pool:
            futures = [pool.submit(_conversation, server, i, s, prefill_s, log) for i, s in enumerate(seeds)]
            hits = sum(f.result() for f in futures)
    except (requests.RequestException, AssertionError) as e:
        assert_alive(server, "during the stress traffic")
        raise AssertionError(f"{method}: {e}\n{server.log_tail(40)}") from e
    st = assert_idle_and_sound(server, timeout=180)
    summary = (f"{method}: outcomes {dict(log.outcomes)} (idle prefill of {ABORT_PREFILL_SUFFIX[0]} tokens: "
               f"{prefill_s * 1000:.0f} ms)")
    assert not log.problems, summary + "\n" + "\n".join(log.problems)
    assert log.outcomes["aborted before the first token"] >= 1, "no abort landed before the first token: " + summary
    assert log.outcomes["aborted mid-decode"] + log.outcomes["stream closed mid-decode"] >= 2, summary
    hits_counted = st["chain_hits_total"] - base["chain_hits_total"]
    assert hits_counted >= hits, f"{summary}: {hits_counted} Chain Cache hits counted, {hits} expected at least"
    assert st["evicted_tokens_total"] > base["evicted_tokens_total"], summary
    flush_and_check_empty(server)
    assert_idle_and_sound(server)


# -- 5. contamination through a shared prompt --------------------------------------------------------------
SHARED_TOKENS = 2048


def _shared_context(seed: int) -> tuple[list[int], dict[str, str]]:
    """~2K tokens of haystack prose holding 4 "special magic number" needles (the niah_multikey format the
    model was trained on), and the keys' values."""
    rng = random.Random(seed)
    keys = rng.sample(KEY_WORDS, 4)
    values = {k: str(rng.randrange(10_000, 1_000_000)) for k in keys}
    sents = haystack_sentences()
    start = rng.randrange(len(sents))
    body: list[str] = []
    while len(encode(" ".join(body))) < SHARED_TOKENS - 120:
        body.append(sents[(start + len(body)) % len(sents)])
    for k in keys:
        body.insert(rng.randrange(len(body) + 1), f"The special magic number for {k} is {values[k]}.")
    return encode(" ".join(body)), values


def _question(key: str) -> list[int]:
    return encode(f"\nQuestion: What is the special magic number for {key}?\nAnswer:")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_conversations_eviction_does_not_change_anothers_output(servers: dict[str, ServerProcess],
                                                                   seed: int) -> None:
    server = servers["snapkv256"]
    shared, values = _shared_context(seed)
    key_a, key_b = list(values)[:2]
    prompt_a, prompt_b = shared + _question(key_a), shared + _question(key_b)

    assert_idle_and_sound(server)
    flush_and_check_empty(server)
    (fresh,) = generate(server, [prompt_b], 24, ignore_eos=False)

    assert_idle_and_sound(server)
    flush_and_check_empty(server)
    before = state(server)
    (out_a,) = generate(server, [prompt_a], 24, ignore_eos=False)
    # A's second turn: its Chain Cache record now ends past the shared prompt too.
    (out_a2,) = generate(server, [prompt_a + out_a.ids + _question(list(values)[2])], 24, ignore_eos=False)
    evicted_a = state(server)["evicted_tokens_total"] - before["evicted_tokens_total"]
    assert evicted_a >= len(shared) - SMALL_SNAPKV["budget"], (
        f"A should have evicted most of the {len(shared)}-token shared prompt (budget {SMALL_SNAPKV['budget']}), "
        f"evicted {evicted_a}")
    assert_idle_and_sound(server)
    (after_a,) = generate(server, [prompt_b], 24, ignore_eos=False)

    def show(o: Any) -> str:
        return f"{decode(o.ids)!r} (cached_tokens {o.meta['cached_tokens']})"

    assert after_a.ids == fresh.ids, (
        f"B's output changed after A ran on the shared {len(shared)}-token prompt under snapkv {SMALL_SNAPKV}: "
        f"fresh server {show(fresh)}, after A {show(after_a)}; B asks for {key_b} = {values[key_b]}; "
        f"A asked for {key_a} = {values[key_a]}, answered {decode(out_a.ids)!r} then {decode(out_a2.ids)!r}, "
        f"evicting {evicted_a} tokens; B's tokens fresh {fresh.ids} vs after A {after_a.ids}")
    common = next(i for i, (x, y) in enumerate(zip(prompt_a, prompt_b)) if x != y)
    assert after_a.meta["cached_tokens"] <= common, (after_a.meta, common)  # never past where B leaves A
    assert_idle_and_sound(server)
