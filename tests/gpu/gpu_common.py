"""What the GPU tests share (tests/gpu/README.md): server flags, prompts of real text from the quality model's
tokenizer, batched greedy generation with top-2 logprobs, output comparisons whose failure says where and how
the tokens differ, and the idle/leak checks.

Batches go to the server as one batched ``/generate`` (``input_ids`` a list of prompts). SGLang hands such a
batch to the scheduler in one message, so every server sees the same waiting queue and runs the same
sequence of prefill chunks and decode batches: greedy tokens can then be compared bit for bit across
servers, while the decode batch still holds several requests (CUDA graphs padded when the size is not a
captured one: 3 -> 4, 5 -> 8).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from sgl_sparse.quality.models import large_model_path
from sgl_sparse.server_process import GPU_SERVER_FLAGS, ServerProcess


def model() -> str:
    """The 11M trained Llama (bf16, 16K context, vocabulary 2,048) the servers load; resolved when a test starts a
    server, so the kernel-level tests run from a tree without the model."""
    return str(large_model_path())


CONTEXT = 16384
FLAGS = [
    *GPU_SERVER_FLAGS,
    "--dtype", "bfloat16", "--context-length", str(CONTEXT),
    "--chunked-prefill-size", "2048",  # prompts of 2-8K tokens prefill in several chunks
    # Several servers share the GPU: a small fixed KV pool (3 KB a token: 0.8 GB) and a static fraction that
    # leaves room for the others starting at the same time.
    "--max-total-tokens", "262144", "--mem-fraction-static", "0.5",
    "--cuda-graph-max-bs", "16", "--max-running-requests", "48",
    "--decode-log-interval", "8",
]
# SGLang 0.5.17's idle leak check (scheduler.on_idle -> invariant_checker: available + evictable + protected
# == total, req pool, tree) raises in the scheduler when SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE is on
# (its default; set here so the tests do not depend on it), which kills the server. The busy-time check
# counts logical lengths and would flag evicted positions (docs/limits.md): off.
ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "0",
    "SGLANG_LOG_MS": "1",
}
LEAK_MARKERS = ("memory leak", "Mem Leak", "double free", "use-after-free")
# > 0: a first difference where either run's top-2 logprob gap is below this counts as a near-tie (bf16
# kernels of different shapes can flip those) and is reported as a warning instead of a failure.
TIE_GAP = float(os.environ.get("SGL_SPARSE_GPU_TIE_GAP", "0"))
DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*? graph: (True|False)")  # "cuda graph: True"


@functools.lru_cache(maxsize=1)
def log_dir() -> Path:
    """Server logs: ``$SGL_SPARSE_GPU_LOG_DIR`` (e.g. under ``$OUT`` on the device) or a temporary folder."""
    d = Path(os.environ.get("SGL_SPARSE_GPU_LOG_DIR") or tempfile.mkdtemp(prefix="sgl-sparse-gpu-"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def ours(name: str, method: str = "dense", config: dict[str, Any] | None = None,
         extra: Sequence[str] = (), env: dict[str, str] | None = None) -> ServerProcess:
    args = [*FLAGS, "--sparse-method", method, "--sparse-config", json.dumps(config or {}), *extra]
    return ServerProcess(model(), args, module="sgl_sparse.launch_server", env={**ENV, **(env or {})},
                         startup_timeout=600,
                         log_path=str(log_dir() / f"{name}.log"))


def vanilla(name: str, backend: str = "flashinfer", extra: Sequence[str] = ()) -> ServerProcess:
    args = [*FLAGS, "--attention-backend", backend, *extra]
    return ServerProcess(model(), args, module="sglang.launch_server", env=ENV, startup_timeout=600,
                         log_path=str(log_dir() / f"{name}.log"))


# -- prompts -----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model())


def encode(text: str) -> list[int]:
    return list(tokenizer().encode(text, add_special_tokens=False))


def decode(ids: Sequence[int]) -> str:
    return str(tokenizer().decode(list(ids)))


@functools.lru_cache(maxsize=1)
def _corpus_ids() -> tuple[int, ...]:
    """The suite's haystack prose (Python's own docstrings), tokenized once."""
    from sgl_sparse.quality.tasks import haystack_sentences

    return tuple(encode(" ".join(haystack_sentences())))


def prose(seed: int, n_tokens: int) -> list[int]:
    """``n_tokens`` of real text from a seeded position (wrapping around): text the model was trained on, so
    greedy continuations are confident and comparisons meaningful."""
    ids = _corpus_ids()
    start = random.Random(seed).randrange(len(ids))
    return [ids[(start + i) % len(ids)] for i in range(n_tokens)]


# -- generation --------------------------------------------------------------------------------------------
@dataclass
class Out:
    ids: list[int]
    logprobs: list[float]  # of the chosen tokens
    top2: list[list[tuple[float, int]]]  # per output step: [(logprob, token id)] best first
    meta: dict[str, Any] = field(repr=False)

    def gap(self, k: int) -> float:
        """Top-2 logprob gap at output step ``k`` (how close greedy was to a tie)."""
        if k >= len(self.top2) or len(self.top2[k]) < 2:
            return float("nan")
        return self.top2[k][0][0] - self.top2[k][1][0]


def _out(item: dict[str, Any]) -> Out:
    meta = item["meta_info"]
    top = [[(float(lp), int(t)) for lp, t, *_ in (step or [])] for step in meta.get("output_top_logprobs") or []]
    lps = [float(lp) for lp, *_ in meta.get("output_token_logprobs") or []]
    return Out(list(item["output_ids"]), lps, top, meta)


def generate(server: ServerProcess, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True,
             timeout: float = 600.0) -> list[Out]:
    """One batched greedy ``/generate`` (see the module docstring); outputs in prompt order."""
    body = {"input_ids": prompts, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}}
    try:
        r = requests.post(f"{server.base_url}/generate", json=body, timeout=timeout)
    except requests.RequestException as e:
        raise AssertionError(f"{server.log_path.stem}: /generate failed ({e}); server log tail:\n"
                             f"{server.log_tail(60)}") from e
    assert r.status_code == 200, f"{server.log_path.stem}: HTTP {r.status_code}: {r.text[:2000]}\n{server.log_tail(40)}"
    data = r.json()
    outs = [_out(x) for x in (data if isinstance(data, list) else [data])]
    assert len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} prompts"
    return outs


def token_agreement(ref: list[Out], got: list[Out]) -> float:
    """The fraction of ``ref``'s output tokens that ``got`` matches position by position (greedy paths that
    drift apart after a near-tie count only up to the split)."""
    return sum(a == b for r, o in zip(ref, got) for a, b in zip(r.ids, o.ids)) / sum(len(r.ids) for r in ref)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _describe(i: int, label: str, ref: Out, got: Out, ref_name: str, got_name: str) -> tuple[str, float]:
    k = _first_difference(ref.ids, got.ids)
    if k >= min(len(ref.ids), len(got.ids)):
        return (f"request {i} ({label}): {ref_name} has {len(ref.ids)} output tokens, {got_name} {len(got.ids)} "
                f"(equal up to {k})", float("inf"))
    n_diff = sum(x != y for x, y in zip(ref.ids, got.ids))
    near = min(ref.gap(k), got.gap(k))
    same_prefix = [abs(x - y) for x, y in zip(ref.logprobs[:k], got.logprobs[:k])]
    drift = f"{max(same_prefix):.2e}" if same_prefix else "-"
    return (f"request {i} ({label}): first different output token at step {k} of {len(ref.ids)}: "
            f"{ref_name} {ref.ids[k]} {decode([ref.ids[k]])!r} vs {got_name} {got.ids[k]} {decode([got.ids[k]])!r}; "
            f"top-2 there: {ref_name} {ref.top2[k] if k < len(ref.top2) else '-'} (gap {ref.gap(k):.4f}), "
            f"{got_name} {got.top2[k] if k < len(got.top2) else '-'} (gap {got.gap(k):.4f}); "
            f"{n_diff} of {len(ref.ids)} tokens differ; max |logprob difference| over the equal first {k} tokens "
            f"{drift}; {ref_name} ...{ref.ids[max(0, k - 4):k + 6]} vs {got_name} ...{got.ids[max(0, k - 4):k + 6]}",
            near)


def assert_same_tokens(ref: list[Out], got: list[Out], ref_name: str, got_name: str, what: str,
                       labels: Sequence[str] | None = None, tie_gap: float | None = None) -> None:
    """Greedy outputs token for token; on failure, per request: the first different step, both tokens, both
    runs' top-2 logprobs there (a gap near 0 is a near-tie, a large one means the runs saw different KV or
    attention), how many tokens differ, and how far the logprobs drifted before it. ``tie_gap``: the near-tie
    bound for this call (default ``SGL_SPARSE_GPU_TIE_GAP``), for runs whose kernels differ by design."""
    gap_bound = TIE_GAP if tie_gap is None else tie_gap
    assert len(ref) == len(got)
    labels = labels or [""] * len(ref)
    problems, ties = [], []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a.ids == b.ids:
            continue
        text, near = _describe(i, labels[i], a, b, ref_name, got_name)
        (ties if gap_bound > 0 and near < gap_bound else problems).append(text)
    if ties:
        warnings.warn(f"{what}: {len(ties)} near-tie difference(s) tolerated (tie gap {gap_bound}):\n"
                      + "\n".join(ties), stacklevel=2)
    assert not problems, (
        f"{what}: {got_name} differs from {ref_name} in {len(problems)} of {len(ref)} requests:\n"
        + "\n".join(problems)
        + "\n(a top-2 gap near 0 at the first difference is a near-tie that bf16 kernels of different shapes can "
          "flip; SGL_SPARSE_GPU_TIE_GAP=0.05 tolerates those. A large gap means different KV or attention.)")


# -- server state ------------------------------------------------------------------------------------------
def state(server: ServerProcess) -> dict[str, Any]:
    return server.server_info()["internal_states"][0]["sgl_sparse"]


def assert_alive(server: ServerProcess, when: str = "") -> None:
    assert server.proc is not None
    rc = server.proc.poll()
    assert rc is None, (f"{server.log_path.stem} exited with {rc} {when} (a failed strict leak check raises in the "
                        f"scheduler and takes the server down); log tail:\n{server.log_tail(80)}")


def assert_idle_and_sound(server: ServerProcess, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until nothing runs, give SGLang's idle leak check time to run (it raises in the scheduler on a
    leak), then check the server is up, our slot accounting matches the tree's, and the log has no leak."""
    name = server.log_path.stem
    deadline = time.monotonic() + timeout
    while True:
        assert_alive(server, "while waiting for idle")
        st = state(server)
        if st["requests_tracked"] == 0 and st["tree_protected_slots"] == 0:
            break
        assert time.monotonic() < deadline, f"{name} did not go idle in {timeout:.0f} s: {st}"
        time.sleep(0.2)
    time.sleep(1.0)
    assert_alive(server, "after going idle")
    r = requests.get(f"{server.base_url}/health", timeout=60)
    assert r.status_code == 200, f"{name}: /health {r.status_code}\n{server.log_tail(60)}"
    st = state(server)
    tree = st["tree_evictable_slots"] + st["tree_protected_slots"]
    assert st["kv_slots_used"] == tree, (
        f"{name}: idle, yet KV slots used {st['kv_slots_used']} != tree slots {tree} (evictable "
        f"{st['tree_evictable_slots']} + protected {st['tree_protected_slots']}): "
        f"{st['kv_slots_used'] - tree:+d} slots; state {st}")
    # Read back without a sync, so it may trail by a step: every step of the traffic has long run here.
    assert st.get("decode_count_mismatches", 0) == 0, f"{name}: decode live counts disagreed with the rows: {st}"
    log = server.log_path.read_text(errors="replace")
    for marker in LEAK_MARKERS:
        assert marker not in log, f"{name}: {marker!r} in the server log:\n" + "\n".join(
            line for line in log.splitlines() if marker in line)[:3000]
    return st


def flush_and_check_empty(server: ServerProcess) -> None:
    """``/flush_cache`` on an idle server returns every slot (read before /health, which runs a request)."""
    name = server.log_path.stem
    r = requests.post(f"{server.base_url}/flush_cache", timeout=60)
    assert r.status_code == 200, f"{name}: /flush_cache {r.status_code}: {r.text}"
    st = state(server)
    assert st["kv_slots_used"] == 0 and st["tree_evictable_slots"] == 0 and st["tree_protected_slots"] == 0, (
        f"{name}: after /flush_cache {st['kv_slots_used']} KV slots are still in use: {st}")


def log_mark(server: ServerProcess) -> int:
    return server.log_path.stat().st_size


def log_since(server: ServerProcess, mark: int) -> str:
    with open(server.log_path, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


def decode_lines(log_text: str) -> list[tuple[int, bool]]:
    """(#running-req, cuda graph) of every ``Decode batch`` line."""
    return [(int(m.group(1)), m.group(2) == "True") for m in DECODE_LINE.finditer(log_text)]


# -- the selection family's server checks (Quest, OmniKV: one module each, so that their servers do not all
# hold the GPU at once) ----------------------------------------------------------------------------------
SELECTION_LENS = [6000, 3000, 4500, 2048, 5000]


def selection_servers(method: str, covering: dict[str, Any], small: dict[str, Any],
                      env: dict[str, str] | None = None) -> dict[str, ServerProcess]:
    """Vanilla FlashInfer; ``method`` with a budget covering the context; ``method`` with a small budget,
    with and without CUDA graphs. The graph servers raise on a host sync in our decode-step code."""
    env = env or {}
    sync = {**env, "SGLSPARSE_SYNC_DEBUG": "error"}
    return {
        "vanilla": vanilla(f"{method}-vanilla-flashinfer"),
        "covering": ours(f"{method}-covering", method, covering, env=sync),
        "small": ours(f"{method}-small-graph", method, small, env=sync),
        "small-eager": ours(f"{method}-small-eager", method, small, extra=["--disable-cuda-graph"], env=env),
    }


def check_covering_equals_vanilla(servers: dict[str, ServerProcess], method: str, seed: int) -> None:
    """A batch of 5 prompts of 2-6K tokens, 96 output tokens: the covering budget gives vanilla's tokens."""
    prompts = [prose(seed + i, n) for i, n in enumerate(SELECTION_LENS)]
    ref = generate(servers["vanilla"], prompts, 96)
    got = generate(servers["covering"], prompts, 96)
    assert_same_tokens(ref, got, "vanilla", f"{method} covering", "batch of 5")
    assert_idle_and_sound(servers["covering"])


def check_graphs_equal_eager(servers: dict[str, ServerProcess], method: str, seed: int) -> None:
    """The small budget on the same kind of batch: graph and eager servers give the same tokens."""
    prompts = [prose(seed + i, n) for i, n in enumerate(SELECTION_LENS)]
    eager = generate(servers["small-eager"], prompts, 96)
    graph = generate(servers["small"], prompts, 96)
    assert_same_tokens(eager, graph, f"{method} eager", f"{method} graph", "batch of 5")
    for name in ("small", "small-eager"):
        assert_idle_and_sound(servers[name])


# -- an eviction method over a per-token store (a composition, e.g. snapkv+fp8_kv): servers "covering", "small" and
# "small-eager" of the composition as above, and the store alone ------------------------------------------------
COMPOSE_COVERING = {"snapkv": {"budget": 16384}}  # above every prompt + output of these checks: nothing is evicted
COMPOSE_SMALL = {"snapkv": {"budget": 1024}}


def check_covering_equals_store(servers: dict[str, ServerProcess], store: str, method: str, seed: int) -> None:
    """Nothing evicted: the composition reads the same slots through the compacted lists as ``servers[store]``
    (the store alone) reads through its rows, so a batch of 5 gives the same 64 tokens."""
    prompts = [prose(seed + i, n) for i, n in enumerate(SELECTION_LENS)]
    before = state(servers["covering"])["evicted_tokens_total"]
    assert_same_tokens(generate(servers[store], prompts, 64), generate(servers["covering"], prompts, 64),
                       store, f"{method} covering", "batch of 5")
    assert state(servers["covering"])["evicted_tokens_total"] == before
    assert_idle_and_sound(servers["covering"])


def check_composition_evicts_and_graphs_equal_eager(servers: dict[str, ServerProcess], method: str,
                                                    seed: int) -> None:
    """The small budget evicts, and the graph server gives the eager server's tokens, leak-free."""
    before = state(servers["small"])["evicted_tokens_total"]
    check_graphs_equal_eager(servers, method, seed)
    assert state(servers["small"])["evicted_tokens_total"] > before
