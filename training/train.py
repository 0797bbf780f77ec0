"""Train the small Llama-architecture models we ship for quality tests (HF ``LlamaForCausalLM``).

    python training/train.py --size small --out OUT --context 2048 --batch 32 --steps 24000 --workers 8
    python training/train.py --size large --out OUT --context 16384 --init-from SHORT_CONTEXT_RUN ...

The exact commands of each shipped model are in its card (``sgl_sparse/assets/*/README.md``).

Data: the synthetic task suite (:mod:`sgl_sparse.quality.tasks`) at random lengths up to ``--context``,
training seeds below 10,000 (evaluation uses 10,000 and above). Loss: next-token prediction on the
whole example, with the answer tokens weighted ``--answer-weight`` times more. The tokenizer is a
byte-level BPE with single-digit tokens (numbers are what the tasks retrieve), trained here.

A run may span several device commands: ``--time-limit-s`` stops cleanly, a checkpoint (model +
optimizer + step) is written to ``--ckpt``, and ``--resume`` continues from it. Weights are saved in
bf16 safetensors, sharded below 15 MB per file (files that come back from the GPU machine are
limited to 16 MB each).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import torch

from sgl_sparse.quality.models import TOKENIZER_FILES
from sgl_sparse.quality.tasks import TASKS, make_example
from sgl_sparse.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS

SIZES = {
    # ~4.3M parameters: CPU tests at 2-4K context.
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    # ~11M parameters: GPU runs at 16-32K context.
    "large": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=64),
    # For the training loop's own test on CPU.
    "test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32),
}
VOCAB = 2048
TRAIN_SEED_LIMIT = 10_000


def build_tokenizer(out: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from sgl_sparse.quality.tasks import haystack_sentences

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    samples = list(haystack_sentences())
    samples += [make_example(t, s, 60).prompt or json.dumps(make_example(t, s, 60).messages)
                for t in TASKS for s in range(50)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(samples, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|end|>",
        "unk_token": "<unk>", "pad_token": "<unk>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|end|>", "unk_token": "<unk>", "pad_token": "<unk>"}))


def encode_example(tokenizer, task: str, seed: int, n_words: int,  # type: ignore[no-untyped-def]
                   confusable: bool = False) -> tuple[list[int], int]:
    """(token ids of prompt + answer + eos, index where the answer starts)."""
    ex = make_example(task, seed, n_words, confusable=confusable)
    if ex.messages is not None:
        text = tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt = tokenizer.encode(ex.prompt, add_special_tokens=False)
    answer = tokenizer.encode(" " + ex.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + answer, len(prompt)


def fit_example_ids(tokenizer, task: str, seed: int, n_words: int, context: int,  # type: ignore[no-untyped-def]
                    confusable: bool = False) -> tuple[list[int], int] | None:
    """encode_example with the haystack shrunk until it fits ``context`` (None if even the smallest does not)."""
    ids, start = encode_example(tokenizer, task, seed, n_words, confusable)
    for _ in range(6):  # never truncate (the answer is at the end): shrink the haystack instead
        if len(ids) <= context:
            break
        n_words = max(5, int(n_words * context / len(ids) * 0.9))
        ids, start = encode_example(tokenizer, task, seed, n_words, confusable)
    return (ids, start) if len(ids) <= context else None


def pad_batch(seqs: list[tuple[list[int], int]], pad_id: int, answer_weight: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(right-padded ids, loss weight per position, answer start per row)."""
    width = max(len(s) for s, _ in seqs)
    x = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    w = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (ids, start) in enumerate(seqs):
        x[i, : len(ids)] = torch.tensor(ids)
        w[i, 1: len(ids)] = 1.0  # weight of predicting token t from t-1
        w[i, max(1, start): len(ids)] = answer_weight
    return x, w, torch.tensor([s for _, s in seqs])


def held_out_set(tokenizer, context: int, n: int, words_per_token: float  # type: ignore[no-untyped-def]
                 ) -> dict[str, list[tuple[list[int], int]]]:
    """``n`` examples per task near the full ``context``, from evaluation seeds (never trained on)."""
    n_words = max(10, int(context * 0.95 * words_per_token))
    out = {}
    for task in TASKS:
        fitted = [fit_example_ids(tokenizer, task, TRAIN_SEED_LIMIT + i, n_words, context) for i in range(n)]
        out[task] = [f for f in fitted if f is not None]
    return out


def held_out_exact_match(model, held_out: dict[str, list[tuple[list[int], int]]], pad_id: int,  # type: ignore[no-untyped-def]
                         device: str, rows: int) -> dict[str, float]:
    """Per task, the fraction of held-out examples whose whole answer greedy decoding gets right."""
    result = {}
    for task, seqs in held_out.items():
        ok = 0.0
        for i in range(0, len(seqs), rows):
            x, w, starts = (t.to(device) for t in pad_batch(seqs[i: i + rows], pad_id, 1.0))
            ok += answer_exact_match(model, x, starts, w) * x.shape[0]
        result[task] = round(ok / max(1, len(seqs)), 3)
    return result


def save_model(model, out: Path) -> None:  # type: ignore[no-untyped-def]
    """bf16 safetensors shards below 15 MB (the limit on a file back from the GPU machine is 16 MB)."""
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size="15MB")


def sample_batch(tokenizer, rng: random.Random, batch: int, context: int, words_per_token: float,  # type: ignore[no-untyped-def]
                 answer_weight: float, task_weights: dict[str, float] | None = None, confusable: float = 0.0,
                 min_context: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch at one random target length (so little padding), from ``min_context`` (default: 32% of
    ``context``) up to ``context``, skewed toward long examples."""
    low = (min_context / context) ** 2 if min_context else 0.1  # the default draws what earlier runs drew
    target = int(context * rng.uniform(low, 1.0) ** 0.5)
    weights = [(task_weights or {}).get(t, 1.0) for t in TASKS]
    seqs = []
    while len(seqs) < batch:
        task = rng.choices(TASKS, weights=weights)[0]
        n_words = max(10, int(target * words_per_token))
        seed = rng.randrange(TRAIN_SEED_LIMIT)
        hard = confusable > 0 and rng.random() < confusable  # no draw at 0: earlier runs' data stays the same
        fitted = fit_example_ids(tokenizer, task, seed, n_words, context, hard)
        if fitted is not None:  # else: this task's minimum does not fit this context; draw another
            seqs.append(fitted)
    return pad_batch(seqs, tokenizer.pad_token_id, answer_weight)


class Batches(torch.utils.data.IterableDataset):
    """Endless batches from worker processes (tokenizing long examples costs more than a small model's step)."""

    def __init__(self, model_dir: Path, seed: int, batch: int, context: int, words_per_token: float,
                 answer_weight: float, start_step: int, task_weights: dict[str, float], confusable: float,
                 min_context: int | None = None) -> None:
        self.model_dir, self.seed, self.batch, self.context = model_dir, seed, batch, context
        self.min_context = min_context
        self.start_step, self.task_weights, self.confusable = start_step, task_weights, confusable
        self.words_per_token, self.answer_weight = words_per_token, answer_weight

    def __iter__(self):  # type: ignore[no-untyped-def]
        from transformers import AutoTokenizer

        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        rng = random.Random(f"{self.seed}:{wid}:{self.start_step}")  # a resumed run draws new data
        while True:
            yield sample_batch(tokenizer, rng, self.batch, self.context, self.words_per_token,
                               self.answer_weight, self.task_weights, self.confusable, self.min_context)


def answer_exact_match(model, x: torch.Tensor, starts: torch.Tensor, w: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    """Teacher-forced greedy exact match of every answer token (= greedy decoding gets the answer)."""
    with torch.no_grad():
        pred = model(input_ids=x).logits.argmax(-1)
    ok = 0
    for i in range(x.shape[0]):
        n = int((w[i] > 0).sum().item()) + 1  # sequence length (position 0 has no weight)
        s = int(starts[i])
        assert 0 < s < n, "the answer must be inside the sequence"
        ok += int(torch.equal(pred[i, s - 1: n - 1], x[i, s:n]))
    return ok / x.shape[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="architecture of a new model (with --init-from: must match DIR's, if given)")
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--answer-weight", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None, help="checkpoint path (default: OUT/ckpt.pt)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from", default=None,
                   help="start from this saved model (weights and tokenizer), e.g. to fine-tune a shipped one")
    p.add_argument("--time-limit-s", type=float, default=None)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--workers", type=int, default=4, help="data-generating processes (0: in the training loop)")
    p.add_argument("--task-weights", default="", help='sampling weight per task, e.g. "vartrack=3" (default 1)')
    p.add_argument("--confusable", type=float, default=0.0,
                   help="fraction of examples drawn with near-miss distractors (vartrack: the other chain's value "
                        "and names share digits and letters with the asked one's)")
    p.add_argument("--task-eval-every", type=int, default=0,
                   help="every N steps: greedy exact match per task on held-out examples near the full --context, "
                        "and the weights saved to OUT (0: only at the end)")
    p.add_argument("--task-eval-n", type=int, default=16, help="held-out examples per task")
    p.add_argument("--stop-at", type=float, default=None,
                   help="stop once every task's held-out exact match reaches this (e.g. 1.0)")
    p.add_argument("--min-context", type=int, default=None,
                   help="shortest example length drawn (default: 32%% of --context); e.g. 1024 at --context 16384 "
                        "so a long-context run keeps short prompts right too")
    args = p.parse_args()
    if args.min_context is not None and not 0 < args.min_context <= args.context:
        p.error(f"--min-context must be in (0, --context], got {args.min_context}")
    if args.stop_at is not None and not args.task_eval_every:
        p.error("--stop-at needs --task-eval-every")
    if not 0.0 <= args.confusable <= 1.0:
        p.error(f"--confusable is a fraction in [0, 1], got {args.confusable}")
    if args.init_from:
        if not (Path(args.init_from) / "config.json").is_file():
            p.error(f"--init-from {args.init_from}: no saved model there (config.json missing)")
        init_cfg = json.loads((Path(args.init_from) / "config.json").read_text())
        init_size = next((n for n, arch in SIZES.items() if all(init_cfg.get(k) == v for k, v in arch.items())), None)
        if args.size is not None and args.size != init_size:
            p.error(f"--size {args.size} does not match --init-from {args.init_from} "
                    f"(a {init_size or 'custom'} model); leave --size out to keep DIR's architecture")
    elif args.size is None:
        p.error("--size is required (except with --init-from, which takes DIR's architecture)")
    task_weights = {}
    for item in filter(None, args.task_weights.split(",")):
        name, _, weight = item.partition("=")
        if name not in TASKS or not weight:
            p.error(f"--task-weights: expected TASK=WEIGHT with TASK in {', '.join(TASKS)}, got {item!r}")
        task_weights[name] = float(weight)

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.ckpt or out / "ckpt.pt")
    if args.init_from:
        for name in TOKENIZER_FILES:
            (out / name).write_bytes((Path(args.init_from) / name).read_bytes())
    if not (out / "tokenizer.json").exists():
        build_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(args.seed)
    if args.init_from:
        model = LlamaForCausalLM.from_pretrained(args.init_from, torch_dtype=torch.float32)
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=4096, rope_theta=500_000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=7, pad_token_id=0, torch_dtype="bfloat16",
            **SIZES[args.size]))
    # Serving reads its context limit from here: a run that extends the context must raise it.
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, args.context)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, log = 0, []
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, log = state["step"], state["log"]
    n_params = sum(p.numel() for p in model.parameters())
    sample = " ".join(make_example("niah_single", 0, 400).prompt.split()[:300])  # type: ignore[union-attr]
    words_per_token = 300 / len(tokenizer.encode(sample))
    batches = iter(torch.utils.data.DataLoader(
        Batches(out, args.seed, args.batch, args.context, words_per_token, args.answer_weight, step, task_weights,
                args.confusable, args.min_context),
        batch_size=None,
        num_workers=args.workers, prefetch_factor=4 if args.workers else None, pin_memory=device == "cuda"))
    held_out = (held_out_set(tokenizer, args.context, args.task_eval_n, words_per_token)
                if args.task_eval_every else {})
    eval_rows = max(1, args.batch // 2)  # forward only, no activations kept: half a training batch fits
    t0, data_wait = time.monotonic(), 0.0
    print(f"{n_params / 1e6:.2f}M parameters, device {device}, from step {step}", flush=True)

    def write_log() -> None:
        (out / "training_log.json").write_text(json.dumps({"args": vars(args), "params": n_params, "log": log},
                                                          indent=2))

    saved_at = -1  # the step whose weights are in OUT

    def task_eval_and_save(at_step: int, save: bool = True) -> float:
        """Log the held-out exact match per task, save the weights (a run cut short keeps them); the worst task's."""
        nonlocal saved_at
        model.eval()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            em = held_out_exact_match(model, held_out, tokenizer.pad_token_id, device, eval_rows)
        model.train()
        log.append({"step": at_step, "held_out_em": em, "context": args.context,
                    "elapsed_s": round(time.monotonic() - t0, 1)})
        print(json.dumps(log[-1]), flush=True)
        if save:
            save_model(model, out)
            write_log()
            saved_at = at_step
        return min(em.values())

    if args.task_eval_every:
        task_eval_and_save(step, save=False)  # where this run starts (e.g. a shorter context's model at this one)
    model.train()
    while step < args.steps:
        elapsed = time.monotonic() - t0
        if args.time_limit_s and elapsed > args.time_limit_s:
            break
        # Cosine decay over whichever ends first, the steps or the time limit, so a time-bounded run anneals.
        progress = max(step / args.steps, elapsed / args.time_limit_s if args.time_limit_s else 0.0)
        lr = args.lr * min(1.0, (step + 1) / 200) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        for g in opt.param_groups:
            g["lr"] = lr
        t_data = time.monotonic()
        x, w, starts = (t.to(device, non_blocking=True) for t in next(batches))
        data_wait += time.monotonic() - t_data  # large when the data workers, not the device, set the pace
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=x).logits.float()
        loss_tok = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1),
                                                     reduction="none").view(x.shape[0], -1)
        loss = (loss_tok * w[:, 1:]).sum() / w[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
                em = answer_exact_match(model, x, starts, w)
            model.train()
            log.append({"step": step, "loss": round(loss.item(), 4), "train_batch_em": em, "lr": lr,
                        "elapsed_s": round(time.monotonic() - t0, 1), "data_wait_s": round(data_wait, 1),
                        "len": x.shape[1]})
            print(json.dumps(log[-1]), flush=True)
        if args.task_eval_every and step % args.task_eval_every == 0:
            if task_eval_and_save(step) >= (args.stop_at if args.stop_at is not None else math.inf):
                print(f"every task reached --stop-at {args.stop_at}", flush=True)
                break
    if args.task_eval_every and not any(e["step"] == step and "held_out_em" in e for e in log):
        task_eval_and_save(step)  # the final weights' held-out numbers
    if saved_at != step:
        save_model(model, out)
        write_log()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log}, ckpt)
    print(f"saved step {step} to {out}", flush=True)


if __name__ == "__main__":
    main()
