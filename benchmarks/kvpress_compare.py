"""kvpress's implementations of our eviction methods on our trained model and the quality suite's own prompts, so
QUALITY.md can put them beside ours (benchmarks/quality_suite.py through our server, same items).

kvpress pins ``transformers < 5.3`` and SGLang 0.5.17 ``== 5.12.1``, so this runs in an environment of its own
that sees the project's other packages (torch, the tokenizer):

    python -m venv --system-site-packages /tmp/kvvenv
    /tmp/kvvenv/bin/pip install "kvpress==0.5.5" "transformers>=4.56,<5.3"
    PYTHONPATH=. /tmp/kvvenv/bin/python benchmarks/kvpress_compare.py --model-dir sgl_sparse/assets/quality-small \\
        --tokens 2048 --n 50 --budget 512 --presses dense snapkv streamingllm pyramidkv knorm kvzip --json OUT.json

Per prompt, as kvpress's own pipeline does: one prefill forward of the whole prompt with the press active (it
compresses each layer's cache after that layer's attention, so the prefill itself and the first token attend to
everything, as our methods' evictions after the final prefill chunk), then greedy decoding of up to the suite's
24 tokens at the true positions over the compressed cache, stopping at EOS. Each press keeps ``budget`` tokens of
the prompt: ``compression_ratio = 1 - budget / len(prompt)``. Where the methods differ by construction, kvpress's
keep sets are per KV head (each head its own ``budget`` positions; KVzip's, with its default ``layerwise=False``,
also a different count per layer), ours one set per request for every head and layer (the pool frees whole
token slots); the presses below take our methods' window and kernel sizes and sinks where kvpress has those knobs.
The JSON has ``quality_suite.py``'s layout (config -> task -> n, correct, accuracy, failures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_sparse.quality.eval import MAX_NEW_TOKENS, Rendered, build_items, default_workers, tabulate  # noqa: E402
from sgl_sparse.quality.tasks import TASKS, score  # noqa: E402

SEED = 10_000  # quality_suite.py's first example seed: the same items
PRESSES = ("dense", "snapkv", "streamingllm", "pyramidkv", "knorm", "kvzip")


def make_press(name: str, ratio: float) -> Any:
    """The press of ``name`` removing ``ratio`` of the prompt; knobs set to our methods' defaults where it has them
    (SnapKV / PyramidKV: window 32, kernel 5; StreamingLLM: sink 64)."""
    import kvpress

    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=32, kernel_size=5)
    if name == "streamingllm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=64)
    if name == "pyramidkv":
        return kvpress.PyramidKVPress(compression_ratio=ratio, window_size=32, kernel_size=5)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if name == "kvzip":
        return kvpress.KVzipPress(compression_ratio=ratio)
    raise ValueError(f"unknown press {name!r}; known: {', '.join(PRESSES)}")


@torch.inference_mode()
def answer(model: Any, tokenizer: Any, ids: list[int], press_name: str, budget: int) -> str:
    from transformers import DynamicCache

    n = len(ids)
    x = torch.tensor([ids])
    cache = DynamicCache()
    if press_name == "dense" or n <= budget:
        out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
    else:
        with make_press(press_name, 1.0 - budget / n)(model):
            out = model(input_ids=x, past_key_values=cache, logits_to_keep=1)
    tok = out.logits[0, -1].argmax()
    generated = [int(tok)]
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])
    for i in range(MAX_NEW_TOKENS - 1):
        if generated[-1] in stop:
            break
        out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                    position_ids=torch.tensor([[n + i]]))
        generated.append(int(out.logits[0, -1].argmax()))
    return str(tokenizer.decode(generated, skip_special_tokens=True))


def evaluate(model: Any, tokenizer: Any, items: list[Rendered], press_name: str, budget: int) -> dict[str, Any]:
    results = []
    for item in items:
        text = answer(model, tokenizer, item.turns[-1], press_name, budget)
        results.append((score(item.example, text), text, len(item.turns[-1])))
    return tabulate(items, results)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="sgl_sparse/assets/quality-small")
    p.add_argument("--tokens", type=int, default=2048, help="prompt size")
    p.add_argument("--n", type=int, default=50, help="examples per task")
    p.add_argument("--budget", type=int, default=512, help="prompt tokens each press keeps (per KV head)")
    p.add_argument("--presses", nargs="+", choices=PRESSES, default=list(PRESSES))
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the model's dtype (bfloat16: as our CPU server runs the quality models)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from importlib.metadata import version

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype),
                                                 attn_implementation="sdpa").eval()
    items = build_items(tokenizer, list(TASKS), args.n, args.tokens, SEED, chain=False, workers=default_workers())
    print(f"kvpress {version('kvpress')}, transformers {version('transformers')}, {args.model_dir}, "
          f"{len(items)} prompts of <= {args.tokens} tokens, "
          f"budget {args.budget}, {args.dtype}", flush=True)
    results: dict[str, Any] = {}
    for name in args.presses:
        t0 = time.monotonic()
        key = f"kvpress {name}" + ("" if name == "dense" else f" (keeps {args.budget})") + f" @ {args.tokens}"
        results[key] = evaluate(model, tokenizer, items, name, args.budget)
        accs = {t: r["accuracy"] for t, r in results[key].items()}
        mean = sum(accs.values()) / len(accs)
        print(f"{key}: mean {mean:.3f} " + " ".join(f"{t} {a:.2f}" for t, a in accs.items())
              + f" ({time.monotonic() - t0:.0f} s)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
