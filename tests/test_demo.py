"""``python -m sgl_sparse.demo``: the same agent program under dense and under SnapKV, on CPU servers with
the small trained model; the eviction run keeps far fewer KV slots and still answers right."""

from __future__ import annotations

import pytest

from sgl_sparse import demo
from tests.server_pool import FORKED_CHILDREN


def test_default_methods_and_bad_flags_fail_before_any_server() -> None:
    _, methods = demo.parse_args([])
    assert methods == [("dense", {}), ("snapkv", {"budget": 512})]
    _, methods = demo.parse_args(["--sparse-method", "streamingllm", "--sparse-config", '{"recent_tokens": 256}'])
    assert methods == [("dense", {}), ("streamingllm", {"recent_tokens": 256})]
    assert demo.parse_args(["--sparse-method", "dense"])[1] == [("dense", {})]
    for bad in (["--sparse-method", "nope"], ["--sparse-config", '{"budgett": 1}'], ["--methods", ","]):
        with pytest.raises(SystemExit) as e:
            demo.parse_args(bad)
        assert e.value.code == 2


def test_the_conversation_asks_for_the_first_tool_results_fact() -> None:
    conv = demo.conversation()
    assert len(conv.tool_results) == 4 and conv.fact_turn == 1
    assert f"is {conv.answer}." in conv.tool_results[0]
    assert all(conv.answer not in t for t in conv.tool_results[1:])


@pytest.mark.server
def test_demo_answers_right_under_eviction_with_fewer_kv_slots(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in FORKED_CHILDREN.items():  # its servers' children fork (tests/README.md); the demo is unchanged
        monkeypatch.setenv(k, v)
    runs = demo.main([])
    out = capsys.readouterr().out
    dense, snap = runs
    assert (dense.method, snap.method) == ("dense", "snapkv")
    assert dense.right and snap.right and dense.answer == snap.answer, out
    assert "verdict: answers equal; right under dense and snapkv" in out
    assert [t.name for t in dense.turns] == [t.name for t in snap.turns] == ["step1", "step2", "step3", "step4",
                                                                            "answer"]
    # Same program, same greedy outputs: the same logical conversation under both.
    assert [(t.logical, t.output) for t in dense.turns] == [(t.logical, t.output) for t in snap.turns], out

    # Dense keeps every token; SnapKV really evicts: the last turn's context is ~3x the budget, and what it
    # keeps is the budget plus the answer's decoded tokens.
    budget = snap.config["budget"]
    assert all(t.kv_slots_used == t.logical for t in dense.turns), out
    last = snap.turns[-1]
    assert last.logical >= 2.5 * budget, out
    assert budget <= last.kv_slots_used <= budget + demo.ANSWER_TOKENS < dense.turns[-1].kv_slots_used, out
    assert snap.counters["evicted_tokens_total"] > 0 and snap.counters["chain_hits_total"] >= 2, out

    # Every turn reuses the whole conversation so far (cached tokens are logical), under both methods.
    for r in runs:
        cached = [t.cached_tokens for t in r.turns]
        assert all(a < b for a, b in zip(cached, cached[1:])), (r.method, cached)
        assert all(t.cached_tokens >= prev.logical - 1 for prev, t in zip(r.turns, r.turns[1:])), (r.method, out)
