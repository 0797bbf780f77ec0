"""The synthetic task suite, the eval sizing, and a training smoke run (no server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_sparse.quality.tasks import TASKS, make_example, score

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("task", TASKS)
def test_examples_are_deterministic_and_answerable(task: str) -> None:
    a, b = make_example(task, 7, 300), make_example(task, 7, 300)
    assert a == b and make_example(task, 8, 300) != a
    text = a.prompt if a.prompt is not None else json.dumps(a.messages)
    if task == "freqword":
        words = text.split("Words: ")[1].split(".")[0].split()
        counts = {w: words.count(w) for w in set(words)}
        assert a.answer.split(", ") == sorted(counts, key=lambda w: -counts[w])[:3]
    else:
        for part in a.answer.split(", "):
            assert part in text
    assert score(a, f" {a.answer}.\nmore text") and not score(a, "0")
    assert len(text.split()) >= 150  # a real haystack (or word list) around the needles


def test_sizing_to_a_token_budget(tiny_model: str) -> None:
    from transformers import AutoTokenizer

    from sgl_sparse.quality.eval import MAX_NEW_TOKENS, fit_example, render

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for task in TASKS:
        ex = fit_example(task, 1, tok, 1024)
        n = len(render(ex, tok, chain=False).turns[-1])
        assert 700 < n <= 1024 - MAX_NEW_TOKENS, (task, n)
    chained = render(fit_example("agent_recall", 1, tok, 1024), tok, chain=True).turns
    assert len(chained) == 5 and all(a == b[: len(a)] for a, b in zip(chained, chained[1:]))


def test_training_smoke_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "m"
    cmd = [sys.executable, str(ROOT / "training" / "train.py"), "--size", "test", "--out", str(out), "--batch", "4",
           "--context", "512", "--eval-every", "10", "--lr", "3e-3"]
    r = subprocess.run([*cmd, "--steps", "20"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    log = json.loads((out / "training_log.json").read_text())["log"]
    assert [e["step"] for e in log] == [10, 20]
    r = subprocess.run([*cmd, "--steps", "40", "--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    log = json.loads((out / "training_log.json").read_text())["log"]
    assert [e["step"] for e in log] == [10, 20, 30, 40]
    assert log[-1]["loss"] < log[0]["loss"]
    shards = list(out.glob("*.safetensors"))
    assert shards and all(s.stat().st_size < 15 * 2**20 for s in shards)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.server
def test_eval_cli_against_a_real_server(server, tiny_model: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Plumbing only: the random-weight tiny model answers nothing right (the trained model's
    accuracy test comes with the trained model)."""
    out = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "-m", "sgl_sparse.quality.eval", "--url", server.base_url, "--model-dir",
                        tiny_model, "--tokens", "512", "--n", "2", "--chain", "--json", str(out),
                        "--baseline-url", server.base_url], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| task | accuracy | max prompt tokens | baseline |" in r.stdout
    runs = json.loads(out.read_text())
    assert set(runs) == {"server", "baseline"} and set(runs["server"]) == set(TASKS)
    assert all(row["n"] == 2 and 0 < row["tokens"] <= 512 for row in runs["server"].values())
    assert runs["server"] == runs["baseline"]  # greedy, same server: same outputs
