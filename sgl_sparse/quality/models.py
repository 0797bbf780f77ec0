"""The trained models we ship (``sgl_sparse/assets/``), and random-weight twins for negative controls."""

from __future__ import annotations

import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _shipped(name: str) -> Path:
    path = ASSETS / name
    if not (path / "config.json").exists() or not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"the trained model {name} is missing from {path} (is the package installed "
                                "from a checkout with its assets?)")
    return path


def small_model_path() -> Path:
    """The 4.0M-parameter model trained on the task suite at 2K context (card: its README.md)."""
    return _shipped("quality-small")


def large_model_path() -> Path:
    """The 11.0M-parameter model for GPU runs, trained up to 16K context (card: its README.md)."""
    return _shipped("quality-large")


def write_random_twin(model_dir: str | Path, out: str | Path, seed: int = 0, max_shard_size: str = "50GB") -> Path:
    """Same architecture and tokenizer as ``model_dir``, freshly initialized weights (bf16), sharded
    above ``max_shard_size``."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(model_dir) / name, out / name)
    return out
