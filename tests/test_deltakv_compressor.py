"""DeltaKV's compressor arithmetic (sgl_sparse/methods/compression/deltakv_compressor.py) against plain-torch
references written here, its files, and its trainer (training/deltakv.py) on the shipped small model."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from sgl_sparse.methods.compression.deltakv_compressor import (
    Compressor,
    CompressorConfig,
    auto_full_layers,
    centre_mean,
    is_centre,
    load_compressor,
    nearest_centres,
    sequence_centres,
)
from sgl_sparse.quality.models import small_model_path

ROOT = Path(__file__).resolve().parents[1]


def _reference_pointers(kv: torch.Tensor, pos: list[int], ckv: torch.Tensor, cpos: list[int],
                        k: int) -> list[list[int]]:
    out = []
    for i, p in enumerate(pos):
        cands = sorted((float(((kv[i] - ckv[j]) ** 2).sum()), j) for j in range(len(cpos)) if cpos[j] < p)
        picks = [j for _, j in cands[:k]]
        out.append(picks + [-1] * (k - len(picks)))
    return out


def test_nearest_centres_are_the_nearest_earlier_ones() -> None:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(37, 8, generator=gen)
    pos = list(range(37))
    cpos = [p for p in pos if p % 10 == 0]
    ckv = kv[cpos]
    got = nearest_centres(kv, torch.tensor(pos), ckv, torch.tensor(cpos), 4)
    assert got.tolist() == _reference_pointers(kv, pos, ckv, cpos, 4)
    assert got[0].tolist() == [-1] * 4 and got[5].tolist() == [0, -1, -1, -1]  # only earlier centres count
    assert is_centre(torch.tensor(pos), 10).nonzero().flatten().tolist() == cpos


def test_centre_mean_skips_unused_pointers_and_a_sequence_keeps_its_centres() -> None:
    ckv = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0]])
    mean = centre_mean(ckv, torch.tensor([[0, 2, -1], [1, -1, -1], [-1, -1, -1]]))
    torch.testing.assert_close(mean, torch.tensor([[3.0, 2.0], [3.0, 2.0], [0.0, 0.0]]))
    kv = torch.randn(25, 6)
    mask, means = sequence_centres(kv, 10, 2)
    assert mask.nonzero().flatten().tolist() == [0, 10, 20]
    torch.testing.assert_close(means[mask], kv[mask])
    want = torch.stack([kv[[c for c in (0, 10, 20) if c < 15]].mean(0)])  # token 15: two earlier centres, k=2
    torch.testing.assert_close(means[15:16], want)


def test_round_trip_and_files(tmp_path: Path) -> None:
    cfg = CompressorConfig(kv_dim=16, latent_dim=4, intermediate=12, layers=(1, 3), stride=10, neighbors=4)
    comp = Compressor(cfg)
    kv, c = torch.randn(5, 16), torch.randn(5, 16)
    z = comp.encode(3, kv, c)
    down = comp.down["3"]
    torch.testing.assert_close(z, down(kv) - down(c))
    torch.testing.assert_close(comp.decode(3, z, c), comp.up["3"](z) + c)
    comp.save(tmp_path)
    back = load_compressor(tmp_path)
    assert back.config == cfg
    with torch.no_grad():  # saved in bf16, as served
        torch.testing.assert_close(back.round_trip(1, kv, c), comp.round_trip(1, kv, c), atol=0.05, rtol=0.05)
    assert load_compressor(tmp_path / "deltakv").config == cfg
    with pytest.raises(ValueError, match="no compressor file"):
        load_compressor(tmp_path / "elsewhere")
    (tmp_path / "deltakv" / "config.json").write_text(json.dumps({**json.loads(cfg.to_json()), "latent_dim": 5}))
    with pytest.raises(ValueError, match="does not match"):
        load_compressor(tmp_path)


def test_full_layers_scale_the_originals() -> None:
    assert auto_full_layers(32) == (0, 2, 7, 13, 16, 26)
    assert auto_full_layers(4) == (0,) and auto_full_layers(6) == (0,)
    assert auto_full_layers(16) == (0, 1, 4)


def test_the_trainer_lowers_the_held_out_error(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(small_model_path(), model)
    spec = importlib.util.spec_from_file_location("deltakv_train", ROOT / "training" / "deltakv.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["deltakv_train"] = mod
    spec.loader.exec_module(mod)
    result = mod.train(str(model), model / "deltakv", tokens=3072, steps=60, latent_dim=None, intermediate=None,
                       batch=256, lr=1e-3, eval_every=30, seed=0)
    first, last = result["first"]["eval_residual_error"], result["last"]["eval_residual_error"]
    assert len(first) == 3 and all(b < 0.8 * a for a, b in zip(first, last)), (first, last)
    comp = load_compressor(model)
    assert comp.config.layers == (1, 2, 3) and comp.config.kv_dim == 256 and comp.config.latent_dim == 32
    log = [json.loads(line) for line in (model / "deltakv" / "training_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [0, 30, 60]
