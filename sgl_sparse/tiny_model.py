"""Write a tiny Llama checkpoint directory for tests and the demo (no model hub needed).

    python -m sgl_sparse.tiny_model OUT_DIR [--weights random|none] [--seed 0]

Writes ``config.json`` (LlamaForCausalLM: RoPE, GQA, RMSNorm, SwiGLU), a byte-level BPE tokenizer
trained locally with ``tokenizers`` on text that ships with Python (stdlib docstrings), a chat
template with a ``tool`` role, and, with ``--weights random`` (default), seeded random safetensors
weights scaled so that attention matters for the output (SGLang's ``--load-format dummy`` init is
~1e-3 everywhere, which makes greedy decoding degenerate and hides attention bugs). With
``--weights none`` the directory is meant for ``--load-format dummy``.

Everything is deterministic for a given seed and Python version.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pydoc
import warnings
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Small enough for 2 CPU cores (a 2K-token prefill takes well under a second), big enough to have
# GQA (4 query heads over 2 KV heads) and several layers.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": 2048,
    "bos_token_id": 1,
    "eos_token_id": 7,
    "pad_token_id": 0,
}
CORPUS_MODULES = [
    "json", "argparse", "pathlib", "collections", "itertools", "functools", "dataclasses", "typing",
    "subprocess", "threading", "asyncio", "logging", "random", "string", "textwrap", "re", "os",
]


def _corpus() -> list[str]:
    texts: list[str] = []
    with warnings.catch_warnings():  # inspect touches deprecated aliases such as typing.io
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in CORPUS_MODULES:
            texts.extend(_module_docs(name))
    return texts


def _module_docs(name: str) -> list[str]:
    module = __import__(name)
    texts = [pydoc.getdoc(module)]
    for _, obj in sorted(inspect.getmembers(module), key=lambda kv: kv[0]):
        doc = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
        if doc:
            texts.append(doc)
    return texts


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|end|>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|end|>", "unk_token": "<unk>", "pad_token": "<unk>"})
    )


def write_random_weights(out: Path, config: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def w(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    tensors = {
        "model.embed_tokens.weight": w(config["vocab_size"], h, std=1.0),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": w(config["vocab_size"], h, std=h**-0.5),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # Larger q/k scale than a trained model's init: sharp attention makes outputs depend on
        # which positions are attended, so a wrong KV view changes the tokens.
        tensors[p + "self_attn.q_proj.weight"] = w(nh * hd, h, std=2.0 * h**-0.5)
        tensors[p + "self_attn.k_proj.weight"] = w(nkv * hd, h, std=2.0 * h**-0.5)
        tensors[p + "self_attn.v_proj.weight"] = w(nkv * hd, h, std=h**-0.5)
        tensors[p + "self_attn.o_proj.weight"] = w(h, nh * hd, std=(nh * hd) ** -0.5)
        tensors[p + "mlp.gate_proj.weight"] = w(inter, h, std=h**-0.5)
        tensors[p + "mlp.up_proj.weight"] = w(inter, h, std=h**-0.5)
        tensors[p + "mlp.down_proj.weight"] = w(h, inter, std=inter**-0.5)
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def write_tiny_model(out_dir: str | os.PathLike[str], weights: str = "random", seed: int = 0) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 7, "do_sample": False})
    )
    write_tokenizer(out, TINY_CONFIG["vocab_size"])
    if weights == "random":
        write_random_weights(out, TINY_CONFIG, seed)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--weights", choices=["random", "none"], default="random")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_tiny_model(args.out_dir, args.weights, args.seed))


if __name__ == "__main__":
    main()
