"""Put a model that `tools/device/device_session.sh collect` brought back into its asset folder.

    python training/ship_collected.py /work/.device/7 --model large --phase gpu-5-16k

``collect`` sends per model ``NAME-meta.tar`` (``NAME/*.json``: config, tokenizer, shard index, the
run's ``training_log.json``) and the weight shards as ``NAME-model*.safetensors``. This checks that
they form a complete model that loads, then replaces the weights, config and tokenizer in
``sgl_sparse/assets/quality-NAME`` (the card, ``README.md``, stays: update it by hand) and appends the
run's log to ``training_log.jsonl``, each entry tagged ``phase``. A phase already in that log is an
error, so one run cannot be appended twice. Nothing is changed unless every check passes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from sgl_sparse.quality.models import TOKENIZER_FILES

# The checkout's assets (not an installed copy's): what this script changes is committed from there.
ASSETS = Path(__file__).resolve().parents[1] / "sgl_sparse" / "assets"
REPLACED = ("config.json", "generation_config.json", *TOKENIZER_FILES, "model.safetensors.index.json")


def stage(collected: Path, name: str, staging: Path) -> list[dict]:
    """The model's files, named as in a model folder, into ``staging``; the run's log entries."""
    meta = collected / f"{name}-meta.tar"
    if not meta.is_file():
        raise ValueError(f"{meta} is missing (did collect run after training {name}?)")
    with tarfile.open(meta) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(f"{name}/")
                   and m.name.endswith(".json") and "/" not in m.name[len(name) + 1:]]
        for m in members:
            (staging / Path(m.name).name).write_bytes(tar.extractfile(m).read())  # type: ignore[union-attr]
    for required in ("config.json", "tokenizer.json", "training_log.json"):
        if not (staging / required).is_file():
            raise ValueError(f"{meta} has no {name}/{required}")
    shards = sorted(collected.glob(f"{name}-model*.safetensors"))
    if not shards:
        raise ValueError(f"no {name}-model*.safetensors in {collected}")
    for shard in shards:
        shutil.copyfile(shard, staging / shard.name[len(name) + 1:])
    index = staging / "model.safetensors.index.json"
    if index.is_file():
        named = set(json.loads(index.read_text())["weight_map"].values())
        have = {p.name for p in staging.glob("*.safetensors")}
        if named != have:
            raise ValueError(f"the shard index names {sorted(named)}, but {collected} has {sorted(have)}")
    from transformers import AutoTokenizer, LlamaForCausalLM

    _, info = LlamaForCausalLM.from_pretrained(staging, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}  # missing, unexpected, mismatched keys; error messages
    if problems:  # from_pretrained only warns: a shard short of tensors would load with random ones
        raise ValueError(f"the collected weights do not match their config: {problems}")
    AutoTokenizer.from_pretrained(staging)
    return json.loads((staging / "training_log.json").read_text())["log"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("collected", type=Path, help="the folder collect's files came back to")
    p.add_argument("--model", required=True, choices=["small", "large"], help="the NAME in NAME-meta.tar")
    p.add_argument("--phase", required=True, help="tag for this run's entries in training_log.jsonl, e.g. gpu-5-16k")
    p.add_argument("--dest", type=Path, default=None, help="model folder (default: sgl_sparse/assets/quality-MODEL)")
    args = p.parse_args()
    dest = args.dest or ASSETS / f"quality-{args.model}"
    if not (dest / "config.json").is_file():
        p.error(f"{dest} is not a model folder (no config.json)")
    log_file = dest / "training_log.jsonl"
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    known = {json.loads(line).get("phase") for line in lines}
    if args.phase in known:
        p.error(f"phase {args.phase!r} is already in {log_file}: pick a new tag")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        try:
            entries = stage(args.collected, args.model, Path(tmp))
        except (ValueError, OSError) as e:
            p.error(str(e))
        for old in [*dest.glob("*.safetensors"), *(dest / f for f in REPLACED)]:
            old.unlink(missing_ok=True)
        for f in Path(tmp).iterdir():
            if f.name != "training_log.json":
                shutil.move(str(f), dest / f.name)
    with log_file.open("a") as out:
        for entry in entries:
            out.write(json.dumps({**entry, "phase": args.phase}) + "\n")
    size = sum(f.stat().st_size for f in dest.glob("*.safetensors"))
    print(f"{dest}: {len(entries)} log entries as phase {args.phase}, weights {size / 1e6:.1f} MB; "
          "now update its README.md (phase row, accuracy)", file=sys.stderr)


if __name__ == "__main__":
    main()
