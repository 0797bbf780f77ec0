"""Train DeltaKV's compressor (sgl_sparse/methods/compression/deltakv_compressor.py) for a model we ship.

    python training/deltakv.py --model-path sgl_sparse/assets/quality-small [--tokens 65536] [--steps 3000]
                               [--latent-dim 32] [--out DIR]

Data: the model's own pre-RoPE K and V (the outputs of every layer's ``k_proj``/``v_proj``, read by forward hooks
of Hugging Face ``transformers``), over the quality suite's generator text at training seeds (never the seeds the
suite evaluates), one sequence of up to 1,024 tokens at a time. Every token that is not a centre is a training
example with the mean of its nearest earlier centres, chosen as serving chooses them (causal, L2 over the
concatenated K and V). A tenth of the sequences are held out.

Loss: the round trip's squared error relative to the token's squared norm, ``|up(down(kv) - down(c)) + c - kv|^2 /
|kv|^2`` for K's half and V's half apart, averaged over both, tokens and sparse layers (the paper's reconstruction
loss on K and V, made scale-free so that V, of a much smaller norm than K, and the layers weigh alike); Adam. The
held-out relative error (and the error over the residual ``kv - c``'s norm: 1.0 is what the centres alone give) is
logged every ``--eval-every`` steps into ``deltakv/training_log.jsonl`` beside the weights (the model folder's
``deltakv/``, or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from sgl_sparse.methods.compression.deltakv_compressor import (
    Compressor,
    CompressorConfig,
    auto_full_layers,
    sequence_centres,
)
from sgl_sparse.prepare import SYNTHETIC, calibration_texts

STRIDE, NEIGHBORS = 10, 4  # the original's center ratio 0.1 and 4 neighbours


def collect(model_path: str, tokens: int, layers: list[int]) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    """Per sequence, each listed layer's pre-RoPE ``kv`` ``[n, 2 * Hkv * d]`` (fp32), and the model's shape."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    attn = [layer.self_attn for layer in model.model.layers]
    seen: dict[tuple[int, str], torch.Tensor] = {}
    handles = [getattr(attn[i], f"{kind}_proj").register_forward_hook(
        lambda _m, _a, out, i=i, kind=kind: seen.__setitem__((i, kind), out[0].detach()))
        for i in layers for kind in ("k", "v")]
    seqs: list[list[torch.Tensor]] = []
    try:
        with torch.no_grad():
            for ids in calibration_texts(SYNTHETIC, tokenizer, tokens):
                model(torch.tensor([ids]))
                seqs.append([torch.cat([seen[(i, "k")], seen[(i, "v")]], dim=-1).float() for i in layers])
    finally:
        for h in handles:
            h.remove()
    cfg = model.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return seqs, {"num_layers": cfg.num_hidden_layers, "kv_dim": 2 * cfg.num_key_value_heads * head_dim}


def examples(seqs: list[list[torch.Tensor]], n_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (kv, centre mean) of every non-centre token of these sequences."""
    out = []
    for j in range(n_layers):
        kvs, means = [], []
        for seq in seqs:
            mask, mean = sequence_centres(seq[j], STRIDE, NEIGHBORS)
            kvs.append(seq[j][~mask])
            means.append(mean[~mask])
        out.append((torch.cat(kvs), torch.cat(means)))
    return out


def relative_error(comp: Compressor, layer: int, kv: torch.Tensor, centre: torch.Tensor,
                   against: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over tokens of the round trip's squared error over ``against``'s squared norm (default: ``kv``'s), K's
    half and V's half each over its own norm, averaged: K's norm is many times V's, and over the whole ``kv`` a
    loss would let V go (a compressor trained so restored K to ~7% and V to ~80% of their norms)."""
    err = (comp.round_trip(layer, kv, centre) - kv).pow(2)
    ref = (kv if against is None else against).pow(2)
    half = kv.shape[-1] // 2
    parts = [err[..., s].sum(-1) / ref[..., s].sum(-1).clamp(min=1e-6) for s in (slice(0, half), slice(half, None))]
    return ((parts[0] + parts[1]) / 2).mean()


def train(model_path: str, out: Path, tokens: int, steps: int, latent_dim: int | None, intermediate: int | None,
          batch: int, lr: float, eval_every: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    from transformers import AutoConfig

    num_layers = AutoConfig.from_pretrained(model_path).num_hidden_layers
    sparse = [i for i in range(num_layers) if i not in auto_full_layers(num_layers)]
    seqs, shape = collect(model_path, tokens, sparse)
    held = max(1, len(seqs) // 10)
    train_ex, eval_ex = examples(seqs[held:], len(sparse)), examples(seqs[:held], len(sparse))
    kv_dim = shape["kv_dim"]
    cfg = CompressorConfig(kv_dim=kv_dim, latent_dim=latent_dim or kv_dim // 8, intermediate=intermediate or kv_dim,
                           layers=tuple(sparse), stride=STRIDE, neighbors=NEIGHBORS)
    comp = Compressor(cfg)
    opt = torch.optim.Adam(comp.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "training_log.jsonl"
    log_path.write_text("")
    start = time.time()

    def evaluate(step: int, train_loss: float) -> dict[str, Any]:
        with torch.no_grad():
            per = [float(relative_error(comp, layer, kv, c)) for layer, (kv, c) in zip(sparse, eval_ex)]
            # against the residual kv - c: the share of what the centres leave that the latent does not restore
            res = [float(relative_error(comp, layer, kv, c, kv - c)) for layer, (kv, c) in zip(sparse, eval_ex)]
        row = {"step": step, "train_loss": round(train_loss, 6), "eval_relative_error": [round(x, 6) for x in per],
               "eval_residual_error": [round(x, 4) for x in res], "seconds": round(time.time() - start, 1)}
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        return row

    first = evaluate(0, float("nan"))
    loss_value = float("nan")
    for step in range(1, steps + 1):
        loss = torch.zeros(())
        for layer, (kv, c) in zip(sparse, train_ex):
            pick = torch.randint(0, kv.shape[0], (batch,))
            loss = loss + relative_error(comp, layer, kv[pick], c[pick])
        loss = loss / len(sparse)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if step % eval_every == 0 or step == steps:
            last = evaluate(step, loss_value)
    comp.save(out.parent if out.name == "deltakv" else out)
    return {"config": cfg, "first": first, "last": last, "train_tokens": int(train_ex[0][0].shape[0])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--out", default=None, help="folder for deltakv/ (default: the model folder)")
    p.add_argument("--tokens", type=int, default=65536, help="training and held-out tokens in all")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--latent-dim", type=int, default=None, help="default: kv_dim / 8")
    p.add_argument("--intermediate", type=int, default=None, help="default: kv_dim")
    p.add_argument("--batch", type=int, default=2048, help="tokens per layer per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name in ("tokens", "steps", "batch", "eval_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    out = Path(a.out or a.model_path) / "deltakv"
    result = train(a.model_path, out, a.tokens, a.steps, a.latent_dim, a.intermediate, a.batch, a.lr,
                   a.eval_every, a.seed)
    print(f"{out}: {result['config']}, {result['train_tokens']} training tokens a layer")


if __name__ == "__main__":
    main()
