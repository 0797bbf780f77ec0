"""Precompute what a method derives from a model before serving it.

    python -m sgl_sparse.prepare palu --model-path M [--calibration synthetic|FILE] [--calibration-tokens N]

``palu``: the second moments of every layer's pre-rotary K and V over calibration text
(:class:`~sgl_sparse.contract.KVMoments`), whose top eigenvectors are Palu's calibrated bases. They are cached on
disk (``SGL_SPARSE_CACHE``, default ``~/.cache/sgl_sparse``) under a key of the model's K/V projection weights and
the calibration, so a server launched with ``--sparse-config '{"calibration": ...}'`` finds them; a server that
does not computes them at start, the same way.

The forwards run through Hugging Face ``transformers`` (a model loaded a second time, on the GPU when there is
one): the K/V projections' outputs are read by forward hooks, before the rotary embedding is applied.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sgl_sparse.contract.model import KVMoments, head_digests

logger = logging.getLogger(__name__)
SYNTHETIC = "synthetic"
RIDGE = 1e-5  # Palu's: times the mean diagonal of the layer input's Gram matrix
TEXT_TOKENS = 1024  # tokens per calibration text (SparseEngine's: 32 texts of 1,024)
SYNTHETIC_SEED = 900_000  # far from the seeds the quality suite evaluates


def cache_dir() -> Path:
    return Path(os.environ.get("SGL_SPARSE_CACHE", Path.home() / ".cache" / "sgl_sparse"))


def _source_digest(source: str) -> str:
    if source == SYNTHETIC:
        return SYNTHETIC
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"palu: calibration {source!r} is neither 'none', 'synthetic' nor a file")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:24]


def moments_path(k_heads: Sequence[Sequence[str]], v_heads: Sequence[Sequence[str]], source: str,
                 tokens: int) -> Path:
    """Where the moments of a model whose K and V heads have these digests (per layer, as
    :class:`~sgl_sparse.contract.KVMoments` holds them) go."""
    heads = [list(layer) for layer in (*k_heads, *v_heads)]
    key = hashlib.sha256(json.dumps([heads, _source_digest(source), tokens, RIDGE]).encode()).hexdigest()
    return cache_dir() / "palu" / f"moments-{key[:24]}.pt"


def calibration_texts(source: str, tokenizer: Any, tokens: int) -> list[list[int]]:
    """Token ids of calibration texts, at most :data:`TEXT_TOKENS` each, ``tokens`` in all: the quality suite's
    generator (``synthetic``), a ``.jsonl`` file's ``"text"`` fields, or a text file cut into pieces."""
    if source == SYNTHETIC:
        from sgl_sparse.quality.tasks import TASKS, make_example

        texts = []
        for i in range(max(1, -(-tokens // TEXT_TOKENS))):
            ex = make_example(TASKS[i % len(TASKS)], SYNTHETIC_SEED + i, TEXT_TOKENS)
            texts.append(ex.prompt if ex.prompt is not None else "\n".join(m["content"] for m in ex.messages or []))
    elif source.endswith(".jsonl"):
        texts = [json.loads(line)["text"] for line in Path(source).read_text().splitlines() if line.strip()]
    else:
        texts = [Path(source).read_text()]
    ids: list[list[int]] = []
    left = tokens
    for text in texts:
        tok = tokenizer(text, add_special_tokens=True)["input_ids"]
        for at in range(0, len(tok), TEXT_TOKENS):
            piece = tok[at:at + TEXT_TOKENS][:left]
            if piece:
                ids.append(piece)
                left -= len(piece)
            if left <= 0:
                return ids
    if not ids:
        raise ValueError(f"palu: calibration {source!r} holds no text")
    return ids


def _attention_layers(model: Any) -> list[Any]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer.self_attn, p) for layer in layers for p in ("k_proj", "v_proj")):
        raise ValueError(f"palu: {type(model).__name__} has no per-layer k_proj/v_proj to calibrate")
    return list(layers)


def compute_moments(model_path: str, source: str, tokens: int, device: str | None = None) -> KVMoments:
    """Run the calibration texts through the model and sum each layer's K/V outer products (and the inputs' mean
    squared norm, for the ridge)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    layers = _attention_layers(model)
    head_dim = int(getattr(model.config, "head_dim", None) or model.config.hidden_size
                   // model.config.num_attention_heads)
    sums: dict[tuple[int, str], torch.Tensor] = {}
    sq: dict[int, float] = {}
    count = 0

    def hook(layer: int, kind: str) -> Any:
        def run(module: Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            o = out.reshape(-1, out.shape[-1]).double()
            sums[(layer, kind)] = sums.get((layer, kind), 0) + o.T @ o
            if kind == "k":
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sq[layer] = sq.get(layer, 0.0) + float((x * x).sum())
        return run

    handles = [getattr(layer.self_attn, f"{kind}_proj").register_forward_hook(hook(i, kind))
               for i, layer in enumerate(layers) for kind in ("k", "v")]
    try:
        with torch.no_grad():
            for ids in calibration_texts(source, tokenizer, tokens):
                model(torch.tensor([ids], device=device))
                count += len(ids)
    finally:
        for h in handles:
            h.remove()
    k: list[torch.Tensor] = []
    v: list[torch.Tensor] = []
    k_heads: list[list[str]] = []
    v_heads: list[list[str]] = []
    for i, layer in enumerate(layers):
        hidden = layer.self_attn.k_proj.weight.shape[1]
        ridge = RIDGE * sq[i] / (count * hidden)  # 1e-5 x the mean diagonal of the inputs' Gram matrix
        for kind, moments, digests in (("k", k, k_heads), ("v", v, v_heads)):
            w = getattr(layer.self_attn, f"{kind}_proj").weight.detach().double()
            moments.append((sums[(i, kind)] / count + ridge * (w @ w.T)).cpu())
            digests.append(head_digests(w, head_dim))
    return KVMoments(k, v, k_heads, v_heads, head_dim, source, count)


def save(moments: KVMoments, path: Path) -> None:
    """Write ``moments`` to ``path`` whole or not at all (a reader never sees a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(moments, tmp)
    tmp.replace(path)


def load_or_compute(k_heads: Sequence[Sequence[str]], v_heads: Sequence[Sequence[str]], model_path: str,
                    source: str, tokens: int) -> KVMoments:
    """The cached moments of the model whose heads have these digests, computed and cached on first use."""
    path = moments_path(k_heads, v_heads, source, tokens)
    if path.is_file():
        data = torch.load(path, weights_only=False)
        if isinstance(data, KVMoments):
            return data
    logger.info("sgl_sparse: computing Palu's calibration moments (%s, %d tokens) into %s", source, tokens, path)
    moments = compute_moments(model_path, source, tokens)
    save(moments, path)
    return moments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sgl_sparse.prepare", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="method", required=True)
    palu = sub.add_parser("palu", help="Palu's calibration moments")
    palu.add_argument("--model-path", required=True)
    palu.add_argument("--calibration", default=SYNTHETIC, help="'synthetic' or a .txt/.jsonl file")
    palu.add_argument("--calibration-tokens", type=int, default=32 * TEXT_TOKENS)
    palu.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    if args.calibration_tokens < 1:
        parser.error("--calibration-tokens must be >= 1")
    if args.calibration != SYNTHETIC and not Path(args.calibration).is_file():
        parser.error(f"--calibration {args.calibration!r} is neither 'synthetic' nor a file")
    moments = compute_moments(args.model_path, args.calibration, args.calibration_tokens, args.device)
    path = moments_path(moments.k_heads, moments.v_heads, args.calibration, args.calibration_tokens)
    save(moments, path)
    print(f"{path}: {len(moments.k)} layers, {moments.tokens} tokens of {args.calibration}")


if __name__ == "__main__":
    main()
