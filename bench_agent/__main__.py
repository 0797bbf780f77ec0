"""CLI of bench_agent: generate a trace, replay it against a server, or compare vanilla vs ours."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bench_agent import report
from bench_agent.replay import PRUNE_POLICIES, REQUEST_ONLY_POLICIES
from bench_agent.workload import Trace, WorkloadConfig, generate

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "swe_agent.toml"


def _tokenizer(path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench_agent", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="write a trace (JSONL) from a workload config (TOML)")
    g.add_argument("--config", default=str(DEFAULT_CONFIG))
    g.add_argument("--out", required=True)
    g.add_argument("--sessions", type=int, default=None, help="override the config's session count")
    g.add_argument("--seed", type=int, default=None, help="override the config's seed")

    r = sub.add_parser("replay", help="replay a trace against a running server")
    r.add_argument("--url", required=True)
    r.add_argument("--trace", required=True)
    r.add_argument("--tokenizer", required=True, help="the served model's directory (for text lengths)")
    r.add_argument("--client", choices=["openai", "frontend"], default="openai")
    r.add_argument("--label", default=None)
    r.add_argument("--time-scale", type=float, default=1.0, help="multiplies arrival and wait times")
    r.add_argument("--out", default="bench_out")
    r.add_argument("--prune-lag", type=int, default=None,
                   help="pruning mode (openai client): after each turn prune the session's tool results but the "
                        "N most recent through POST /v1/prefix_cache/prune")
    r.add_argument("--prune-roles", default="tool", help="comma-separated roles pruned in pruning mode")
    r.add_argument("--prune-keep-ratio", type=float, default=0.0,
                   help="pruning mode: keep this fraction of each prune's tokens, scored by --prune-policy")
    r.add_argument("--prune-policy", choices=PRUNE_POLICIES, default="knorm",
                   help="pruning mode's scored keep: knorm (key norm, through POST /v1/prefix_cache/prune after each "
                        "turn), snapkv_global or kvzip_global (the turn's own request prunes its prompt, scored "
                        "by its last queries / by KVzip's reconstruction of the ranges; needs --prune-keep-ratio "
                        "> 0)")

    c = sub.add_parser("compare", help="start vanilla SGLang, replay, stop; then sgl_sparse; print side by side")
    c.add_argument("--model-path", required=True)
    c.add_argument("--trace", required=True)
    c.add_argument("--sparse-method", action="append", default=None,
                   help="repeatable; default: dense (parity check)")
    c.add_argument("--sparse-config", action="append", default=None, help="one per --sparse-method")
    c.add_argument("--client", choices=["openai", "frontend"], default="openai")
    c.add_argument("--cpu", action="store_true", help="serve on CPU with the flags of docs/cpu.md")
    c.add_argument("--server-args", default="", help="extra flags for both servers, one string")
    c.add_argument("--time-scale", type=float, default=1.0)
    c.add_argument("--skip-vanilla", action="store_true")
    c.add_argument("--vanilla-backend", choices=["flashinfer", "triton"], default="flashinfer",
                   help="vanilla's --attention-backend on GPU (default flashinfer; ours wraps flashinfer unless "
                        "--server-args gives it --attention-backend triton); ignored with --cpu")
    c.add_argument("--out", default="bench_out")
    c.add_argument("--prune-lag", type=int, default=None,
                   help="pruning mode (openai client): after each turn prune the session's tool results but the "
                        "N most recent through POST /v1/prefix_cache/prune; each method runs twice, without and with")
    c.add_argument("--prune-only", action="store_true",
                   help="with --prune-lag: replay each method in pruning mode only (not also without)")
    c.add_argument("--prune-roles", default="tool", help="comma-separated roles pruned in pruning mode")
    c.add_argument("--prune-keep-ratio", type=float, default=0.0,
                   help="pruning mode: keep this fraction of each prune's tokens, scored by --prune-policy")
    c.add_argument("--prune-policy", choices=PRUNE_POLICIES, default="knorm",
                   help="pruning mode's scored keep: knorm (key norm, through POST /v1/prefix_cache/prune after each "
                        "turn), snapkv_global or kvzip_global (the turn's own request prunes its prompt, scored "
                        "by its last queries / by KVzip's reconstruction of the ranges; needs --prune-keep-ratio "
                        "> 0)")
    args = p.parse_args(argv)
    if args.cmd in ("replay", "compare") and not 0 <= args.prune_keep_ratio < 1:
        p.error(f"--prune-keep-ratio {args.prune_keep_ratio}: expected a number in [0, 1)")
    if args.cmd in ("replay", "compare") and args.prune_policy in REQUEST_ONLY_POLICIES and not args.prune_keep_ratio:
        p.error(f"--prune-policy {args.prune_policy} scores what each prune keeps: give --prune-keep-ratio > 0")
    if args.cmd == "compare" and args.prune_only and args.prune_lag is None:
        p.error("--prune-only replays each method in pruning mode only: give --prune-lag")

    if args.cmd == "generate":
        data = {}
        if args.sessions is not None:
            data["sessions"] = args.sessions
        if args.seed is not None:
            data["seed"] = args.seed
        cfg = dataclasses.replace(WorkloadConfig.from_toml(args.config), **data)
        cfg.validate()
        trace = generate(cfg)
        trace.save(args.out)
        ctx = [s.final_context_tokens() for s in trace.sessions]
        turns = sum(len(s.turns) for s in trace.sessions)
        print(f"{args.out}: {len(trace.sessions)} sessions, {turns} turns, final context min/median/max "
              f"{min(ctx)}/{sorted(ctx)[len(ctx) // 2]}/{max(ctx)} tokens")
        return

    trace = Trace.load(args.trace)
    if args.cmd == "replay":
        from bench_agent.replay import replay

        tok = _tokenizer(args.tokenizer)
        result = replay(args.url, trace, tok, client=args.client, label=args.label or args.url,
                        time_scale=args.time_scale, prune_lag=args.prune_lag,
                        prune_roles=args.prune_roles.split(","), prune_keep_ratio=args.prune_keep_ratio,
                        prune_policy=args.prune_policy)
        summaries = report.save([result], args.out)
    else:
        from bench_agent.compare import compare

        methods = args.sparse_method or ["dense"]
        configs = args.sparse_config or ["{}"] * len(methods)
        if len(configs) != len(methods):
            p.error("give one --sparse-config per --sparse-method")
        results = compare(args.model_path, trace, _tokenizer(args.model_path), list(zip(methods, configs)),
                          client=args.client, cpu=args.cpu, server_args=args.server_args.split(),
                          out_dir=args.out, time_scale=args.time_scale, skip_vanilla=args.skip_vanilla,
                          vanilla_backend=args.vanilla_backend, prune_lag=args.prune_lag,
                          prune_roles=args.prune_roles.split(","), prune_keep_ratio=args.prune_keep_ratio,
                          prune_policy=args.prune_policy, prune_only=args.prune_only)
        summaries = report.save(results, args.out)
    print(report.table(summaries))
    print(json.dumps(summaries), file=sys.stderr)


if __name__ == "__main__":
    main()
