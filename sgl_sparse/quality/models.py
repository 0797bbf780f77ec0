"""The trained models we ship (``sgl_sparse/assets/``), and random-weight twins for negative controls."""

from __future__ import annotations

import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def small_model_path() -> Path:
    """The ~4M-parameter model trained on the task suite at 2K context (card: its README.md)."""
    path = ASSETS / "quality-small"
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"the trained small model is missing from {path} (is the package installed "
                                "from a checkout with its assets?)")
    return path


def write_random_twin(model_dir: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Same architecture and tokenizer as ``model_dir``, freshly initialized weights (bf16)."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(model_dir) / name, out / name)
    return out
