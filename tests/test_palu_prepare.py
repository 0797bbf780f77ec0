"""``python -m sgl_sparse.prepare palu``: the K/V second moments of the small trained model over calibration text,
against moments built here from the model's hidden states (Hugging Face ``transformers``), and the cache the
server reads them back from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sgl_sparse import prepare
from sgl_sparse.contract.model import head_digests
from sgl_sparse.quality.models import small_model_path


def test_moments_are_the_k_v_second_moments_of_the_calibration_text(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(small_model_path())
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97} is item {i}." for i in range(600)))
    got = prepare.compute_moments(path, str(text), 700, device="cpu")
    assert got.tokens == 700 and len(got.k) == 4 and got.head_dim == 64

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prepare.calibration_texts(str(text), AutoTokenizer.from_pretrained(path), 700)
    assert sum(map(len, ids)) == 700 and all(len(p) <= prepare.TEXT_TOKENS for p in ids)
    with torch.no_grad():
        states = [model(torch.tensor([p]), output_hidden_states=True).hidden_states for p in ids]
    for layer_id, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x = torch.cat([layer.input_layernorm(s[layer_id])[0] for s in states]).double()
        n, hidden = x.shape
        ridge = prepare.RIDGE * float((x * x).sum()) / (n * hidden)
        for proj, moment, digests in ((attn.k_proj, got.k, got.k_heads), (attn.v_proj, got.v, got.v_heads)):
            w = proj.weight.double()
            y = x @ w.T
            want = y.T @ y / n + ridge * (w @ w.T)
            torch.testing.assert_close(moment[layer_id], want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
            assert digests[layer_id] == head_digests(proj.weight, 64)


def test_the_cli_caches_what_the_server_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SGL_SPARSE_CACHE", str(tmp_path))
    path = str(small_model_path())
    prepare.main(["palu", "--model-path", path, "--calibration-tokens", "300", "--device", "cpu"])
    assert "300 tokens of synthetic" in capsys.readouterr().out
    files = list((tmp_path / "palu").glob("moments-*.pt"))
    assert len(files) == 1
    stored = torch.load(files[0], weights_only=False)

    def no_forwards(*args: object) -> None:
        raise AssertionError("computed again instead of read from the cache")

    monkeypatch.setattr(prepare, "compute_moments", no_forwards)
    again = prepare.load_or_compute(stored.k_heads, stored.v_heads, path, "synthetic", 300)
    assert torch.equal(again.k[2], stored.k[2])
    with pytest.raises(SystemExit):
        prepare.main(["palu", "--model-path", path, "--calibration", str(tmp_path / "missing.txt")])
    assert "neither 'synthetic' nor a file" in capsys.readouterr().err
