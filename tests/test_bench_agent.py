"""bench_agent: deterministic traces, and replays against real CPU servers (tiny model)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_agent import report
from bench_agent.replay import replay
from bench_agent.workload import Trace, WorkloadConfig, generate
from sgl_sparse.server_process import ServerProcess
from tests.server_pool import FORKED_CHILDREN

CONFIGS = Path(__file__).resolve().parents[1] / "bench_agent" / "configs"


def test_generation_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    cfg = WorkloadConfig.from_toml(CONFIGS / "swe_agent.toml")
    a, b = generate(cfg), generate(cfg)
    assert [dataclasses.asdict(s) for s in a.sessions] == [dataclasses.asdict(s) for s in b.sessions]
    a.save(tmp_path / "t.jsonl")
    loaded = Trace.load(tmp_path / "t.jsonl")
    assert [dataclasses.asdict(s) for s in loaded.sessions] == [dataclasses.asdict(s) for s in a.sessions]
    other = generate(dataclasses.replace(cfg, seed=1))
    assert [s.text_seed for s in other.sessions] != [s.text_seed for s in a.sessions]


def test_default_workload_shape() -> None:
    """Sessions grow toward 64-128K tokens with heavy-tailed tool results of 0.5-16K tokens."""
    trace = generate(WorkloadConfig.from_toml(CONFIGS / "swe_agent.toml"))
    finals = [s.final_context_tokens() for s in trace.sessions]
    assert len(trace.sessions) == 32 and min(finals) > 64_000 and max(finals) <= 120_000
    tools = sorted(t.tool_tokens for s in trace.sessions for t in s.turns if t.tool_tokens)
    outs = [t.output_tokens for s in trace.sessions for t in s.turns]
    assert tools[0] >= 500 and tools[-1] <= 16_000 and tools[len(tools) // 2] < 2_500 < tools[-len(tools) // 20]
    assert 100 <= min(outs) and max(outs) <= 1000


def test_bad_workload_config() -> None:
    with pytest.raises(ValueError, match="unknown workload field"):
        WorkloadConfig.from_dict({"sesions": 3})
    with pytest.raises(ValueError, match="context_limit_tokens"):
        WorkloadConfig.from_dict({"context_limit_tokens": 100})


@pytest.mark.server
@pytest.mark.parametrize("client", ["openai", "frontend"])
def test_replay_against_real_server(server: ServerProcess, tiny_model: str, client: str) -> None:
    from transformers import AutoTokenizer

    trace = generate(WorkloadConfig.from_toml(CONFIGS / "tiny.toml"))
    result = replay(server.base_url, trace, AutoTokenizer.from_pretrained(tiny_model), client=client,
                    label="ours", progress=False)
    s = report.summarize(result)
    assert s["errors"] == 0 and s["sessions"] == 3
    assert s["turns"] == sum(len(x.turns) for x in trace.sessions)
    assert s["output_tokens"] == sum(t.output_tokens for x in trace.sessions for t in x.turns)
    for key in ("wall_s", "output_tok_s", "session_completion_s_p50", "turn_latency_s_p50", "prefix_hit_ratio",
                "kv_capacity"):
        assert s[key] is not None, key
    if client == "openai":
        for key in ("ttft_s_p50", "ttft_s_p90", "ttft_s_p99", "tpot_s_p50", "tpot_s_p90", "tpot_s_p99"):
            assert s[key] is not None and s[key] > 0, key
    prompts = {(t.session, t.turn): t.prompt_tokens for t in result.turns}
    for t in result.turns:  # from turn 2 on, the previous turn's prompt comes from the prefix cache
        if t.turn > 0:
            assert t.cached_tokens >= 0.9 * prompts[(t.session, t.turn - 1)], t
    assert "| prefix_hit_ratio |" in report.table([s])


@pytest.mark.server
def test_compare_driver_on_cpu(tiny_model: str, tmp_path: Path) -> None:
    trace_path = tmp_path / "tiny.jsonl"
    subprocess.run([sys.executable, "-m", "bench_agent", "generate", "--config", str(CONFIGS / "tiny.toml"),
                    "--out", str(trace_path), "--sessions", "2"], check=True, timeout=120)
    r = subprocess.run([sys.executable, "-m", "bench_agent", "compare", "--model-path", tiny_model, "--trace",
                        str(trace_path), "--cpu", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=900, env={**os.environ, **FORKED_CHILDREN})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| metric | vanilla | sgl_sparse:dense | ratio sgl_sparse:dense/vanilla |" in r.stdout
    summaries = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [s["label"] for s in summaries] == ["vanilla", "sgl_sparse:dense"]
    assert all(s["errors"] == 0 and s["turns"] > 0 for s in summaries), summaries
    # Each run's server is the one its label names: only ours logs the sgl_sparse method it serves.
    assert "sgl_sparse: method=dense" in (tmp_path / "out" / "sgl_sparse-dense.server.log").read_text()
    assert "sgl_sparse: method=" not in (tmp_path / "out" / "vanilla.server.log").read_text()
    # A turn's prompt holds the replies the server gave before it, so both runs send the same prompts turn after
    # turn only if dense through our launcher generated vanilla's greedy text; both reuse the prefix cache.
    runs = json.loads((tmp_path / "out" / "runs.json").read_text())
    prompts = [{(t["session"], t["turn"]): t["prompt_tokens"] for t in r["turns"]} for r in runs]
    assert prompts[0] == prompts[1], prompts
    for r in runs:
        assert all(t["cached_tokens"] > 0 for t in r["turns"] if t["turn"] > 0), r["label"]
    assert (tmp_path / "out" / "plots.png").stat().st_size > 0


@pytest.mark.server
def test_replay_pruning_mode(mixed_server: ServerProcess, tiny_model: str) -> None:
    """Pruning mode on a server whose tree can prune: after each turn with a tool result older than the lag, the
    session prunes it; every prune completes and hides tokens, and the turn that continues the pruned prompt is
    still a cache hit for the previous turn's prompt. Each earlier turn's generated reply (ignore_eos, then
    re-rendered by the template as a message) is a second branch below the tool results, which copy-on-write
    would keep whole; the replay's prunes ask for ``evict_branches``, so those stale branches go first and the
    pruned KV is freed (docs/bench_agent.md, "Pruning mode")."""
    import requests
    from transformers import AutoTokenizer

    from tests.test_eviction_e2e import _assert_idle_and_sound

    assert requests.post(f"{mixed_server.base_url}/flush_cache", timeout=30).status_code == 200
    trace = generate(WorkloadConfig.from_toml(CONFIGS / "tiny.toml"))
    lag = 1
    # A prune follows turn i when a later turn exists and the prompt of turn i holds more than `lag` tool results.
    expected = {(s.id, i) for s in trace.sessions for i, t in enumerate(s.turns) if t.tool_tokens and i > lag}
    assert expected, "the tiny trace must give pruning mode something to prune"
    result = replay(mixed_server.base_url, trace, AutoTokenizer.from_pretrained(tiny_model), client="openai",
                    label="prune", progress=False, prune_lag=lag)
    s = report.summarize(result)
    assert s["errors"] == 0, result.errors
    assert {(p.session, p.turn) for p in result.prunes} == expected
    assert all(p.status == "completed" and p.pruned_tokens > 0 for p in result.prunes), result.prunes
    assert s["prunes_completed"] == len(expected) and s["freed_slots"] == sum(p.freed_slots for p in result.prunes)
    # Without evict_branches every prune here freed 0 slots (the stale reply branches shared the tool results).
    assert s["freed_slots"] > 0 and s["evicted_branch_slots"] > 0, result.prunes
    prompts = {(t.session, t.turn): t for t in result.turns}
    for p in result.prunes:
        nxt = prompts[(p.session, p.turn + 1)]
        assert nxt.cached_tokens >= 0.9 * prompts[(p.session, p.turn)].prompt_tokens, (p, nxt)
    assert s["prefix_hit_ratio_after_prune"] is not None and s["prefix_hit_ratio_after_prune"] > 0.5
    assert "| freed_slots |" in report.table([s])
    _assert_idle_and_sound(mixed_server)


@pytest.mark.server
def test_replay_pruning_mode_with_a_scored_keep(mixed_server: ServerProcess, tiny_model: str) -> None:
    """``prune_keep_ratio``: each prune keeps that fraction of its tool tokens (the server takes it over the ranges
    it finds, by key norm), hides and frees the rest, and the continuing turn is still a hit."""
    import requests
    from transformers import AutoTokenizer

    from tests.test_eviction_e2e import _assert_idle_and_sound

    assert requests.post(f"{mixed_server.base_url}/flush_cache", timeout=30).status_code == 200
    trace = generate(WorkloadConfig.from_toml(CONFIGS / "tiny.toml"))
    result = replay(mixed_server.base_url, trace, AutoTokenizer.from_pretrained(tiny_model), client="openai",
                    label="keep", progress=False, prune_lag=1, prune_keep_ratio=0.25)
    s = report.summarize(result)
    assert s["errors"] == 0, result.errors
    assert result.prunes and all(p.status == "completed" for p in result.prunes), result.prunes
    for p in result.prunes:  # a quarter of each prune's range tokens stays (rounded down), the rest is freed
        assert p.kept_tokens == p.pruned_tokens // 4 and p.freed_slots == p.pruned_tokens - p.kept_tokens, p
    assert s["prune_keep_ratio"] == 0.25 and s["prune_kept_tokens"] > 0 and s["freed_slots"] > 0
    prompts = {(t.session, t.turn): t for t in result.turns}
    for p in result.prunes:
        nxt = prompts[(p.session, p.turn + 1)]
        assert nxt.cached_tokens >= 0.9 * prompts[(p.session, p.turn)].prompt_tokens, (p, nxt)
    assert "| prune_kept_tokens |" in report.table([s])
    _assert_idle_and_sound(mixed_server)


@pytest.mark.server
def test_replay_pruning_mode_in_the_turns_own_request(mixed_server: ServerProcess, tiny_model: str) -> None:
    """``prune_policy="snapkv_global"``: no prune call; each turn whose prompt holds more tool results than the lag
    prunes its own (custom_params sgl_sparse_prune: roles, lag, keep_ratio, policy), keeping the quarter of those
    tokens its prompt's last queries attend to most. Every such turn is recorded, the cached sequence hides the
    rest, the next turn is still a hit, and nothing leaks."""
    import requests
    from transformers import AutoTokenizer

    from tests.test_eviction_e2e import _assert_idle_and_sound, _state

    assert requests.post(f"{mixed_server.base_url}/flush_cache", timeout=30).status_code == 200
    before = _state(mixed_server)["evicted_tokens_total"]
    trace = generate(WorkloadConfig.from_toml(CONFIGS / "tiny.toml"))
    result = replay(mixed_server.base_url, trace, AutoTokenizer.from_pretrained(tiny_model), client="openai",
                    label="own", progress=False, prune_lag=1, prune_keep_ratio=0.25, prune_policy="snapkv_global")
    s = report.summarize(result)
    assert s["errors"] == 0, result.errors
    # Turn i prunes its own prompt when that prompt (tool results of turns < i) holds more than `lag` of them.
    expected = {(sess.id, i) for sess in trace.sessions for i in range(len(sess.turns))
                if sum(1 for t in sess.turns[:i] if t.tool_tokens) > 1}
    assert expected and {(p.session, p.turn) for p in result.prunes} == expected
    assert all(p.status == "in_request" for p in result.prunes) and s["prunes_in_request"] == len(expected)
    prompts = {(t.session, t.turn): t for t in result.turns}
    for p in result.prunes:
        if (p.session, p.turn + 1) in prompts:
            nxt = prompts[(p.session, p.turn + 1)]
            assert nxt.cached_tokens >= 0.9 * prompts[(p.session, p.turn)].prompt_tokens, (p, nxt)
    assert _state(mixed_server)["evicted_tokens_total"] > before  # the pruned tool tokens left (3/4 of them)
    assert s["prune_policy"] == "snapkv_global" and "| prunes_in_request |" in report.table([s])
    _assert_idle_and_sound(mixed_server)


def test_pruning_mode_needs_the_openai_client(tiny_model: str) -> None:
    trace = generate(WorkloadConfig.from_toml(CONFIGS / "tiny.toml"))
    with pytest.raises(ValueError, match="openai client"):
        replay("http://127.0.0.1:9", trace, None, client="frontend", prune_lag=1, progress=False)
    with pytest.raises(ValueError, match="give prune_keep_ratio > 0"):
        replay("http://127.0.0.1:9", trace, None, prune_lag=1, prune_policy="snapkv_global", progress=False)
