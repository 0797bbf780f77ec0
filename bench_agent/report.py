"""Metrics of a replay run: a summary dict (JSON), a table, side-by-side comparison, PNG plots."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench_agent.replay import RunResult


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(r: RunResult) -> dict[str, Any]:
    ok = [t for t in r.turns if t.error is None]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    tpot = [(t.end_s - t.start_s - t.ttft_s) / (t.completion_tokens - 1)
            for t in ok if t.ttft_s is not None and t.completion_tokens > 1]
    out_tokens = sum(t.completion_tokens for t in ok)
    prompt_tokens = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    later = [t for t in ok if t.turn > 0]
    session_times = list(r.session_end_s.values())
    summary: dict[str, Any] = {
        "label": r.label,
        "client": r.client,
        "wall_s": round(r.wall_s, 2),
        "sessions": len(r.session_end_s),
        "turns": len(ok),
        "errors": len(r.errors),
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / r.wall_s, 2) if r.wall_s else None,
        "session_completion_s_p50": percentile(session_times, 0.5),
        "session_completion_s_max": max(session_times) if session_times else None,
        "prefix_hit_ratio": round(cached / prompt_tokens, 4) if prompt_tokens else None,
        "prefix_hit_ratio_turn2plus": round(sum(t.cached_tokens for t in later)
                                            / max(1, sum(t.prompt_tokens for t in later)), 4) if later else None,
        "peak_kv_slots": max((u for _, u in r.kv_samples), default=None),
        "kv_capacity": r.kv_capacity or None,
        "max_prompt_tokens": max((t.prompt_tokens for t in ok), default=0),
    }
    for name, vals in (("ttft_s", ttft), ("tpot_s", tpot)):
        for q in (0.5, 0.9, 0.99):
            v = percentile(vals, q)
            summary[f"{name}_p{int(q * 100)}"] = round(v, 4) if v is not None else None
    summary.update(_prune_summary(r, ok))
    turn_latency = [t.end_s - t.start_s for t in ok]
    summary["turn_latency_s_p50"] = percentile(turn_latency, 0.5)
    summary["turn_latency_s_mean"] = statistics.fmean(turn_latency) if turn_latency else None
    return summary


def _prune_summary(r: RunResult, ok: list[Any]) -> dict[str, Any]:
    """Pruning mode's effect: how many prunes, by status, tokens hidden and KV slots freed, their latency, and
    the prefix-cache hit ratio of the turns that continued a pruned prompt (should stay that of any turn)."""
    if r.prune_lag is None:
        return {}
    done = [p for p in r.prunes if p.status == "completed"]
    # A turn's own prune (prune_policy snapkv_global) reports no counts: its turn's latency is not a prune's.
    own = [p for p in r.prunes if p.status == "in_request"]
    pruned_turns = {(p.session, p.turn + 1) for p in done if p.pruned_tokens} | {(p.session, p.turn + 1) for p in own}
    after = [t for t in ok if (t.session, t.turn) in pruned_turns]
    latency = percentile([p.end_s - p.start_s for p in r.prunes if p.status != "in_request"], 0.5)
    return {
        "prune_lag": r.prune_lag,
        "prune_keep_ratio": r.prune_keep_ratio,
        "prune_policy": r.prune_policy,
        "prunes": len(r.prunes),
        "prunes_in_request": len(own),
        "prunes_completed": len(done),
        "prunes_blocked": sum(p.status == "blocked" for p in r.prunes),
        "prunes_failed": sum(p.status in ("failed", "error") for p in r.prunes),
        "pruned_tokens": sum(p.pruned_tokens for p in done),
        "freed_slots": sum(p.freed_slots for p in done),
        "evicted_branch_slots": sum(p.evicted_branch_slots for p in done),
        "prune_kept_tokens": sum(p.kept_tokens for p in done),
        "prune_s_p50": round(latency, 4) if latency is not None else None,
        "prefix_hit_ratio_after_prune": round(sum(t.cached_tokens for t in after)
                                              / max(1, sum(t.prompt_tokens for t in after)), 4) if after else None,
    }


ROWS = ["wall_s", "sessions", "turns", "errors", "output_tokens", "output_tok_s", "session_completion_s_p50",
        "session_completion_s_max", "ttft_s_p50", "ttft_s_p90", "ttft_s_p99", "tpot_s_p50", "tpot_s_p90",
        "tpot_s_p99", "turn_latency_s_p50", "prefix_hit_ratio", "prefix_hit_ratio_turn2plus", "peak_kv_slots",
        "kv_capacity", "max_prompt_tokens", "prune_lag", "prune_keep_ratio", "prune_policy", "prunes",
        "prunes_in_request", "prunes_completed", "prunes_blocked", "prunes_failed", "pruned_tokens",
        "prune_kept_tokens", "freed_slots", "evicted_branch_slots", "prune_s_p50", "prefix_hit_ratio_after_prune"]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(summaries: list[dict[str, Any]]) -> str:
    """Markdown table, one column per run, plus ratios to the first run when there are two or more."""
    head = ["metric", *[s["label"] for s in summaries]]
    if len(summaries) > 1:
        head += [f"ratio {s['label']}/{summaries[0]['label']}" for s in summaries[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in ROWS:
        cells = [row, *[_fmt(s.get(row)) for s in summaries]]
        for s in summaries[1:]:
            a, b = summaries[0].get(row), s.get(row)
            ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
            cells.append(f"{b / a:.3f}" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save(results: list[RunResult], out_dir: str | Path, plots: bool = True) -> list[dict[str, Any]]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r) for r in results]
    (out / "summary.json").write_text(json.dumps(summaries, indent=2))
    (out / "runs.json").write_text(json.dumps([asdict(r) for r in results]))
    (out / "table.md").write_text(table(summaries) + "\n")
    if plots and not plot(results, out / "plots.png"):
        print("bench_agent: matplotlib is not installed, no plots (pip install 'sgl-sparse[bench]')")
    return summaries


def plot(results: list[RunResult], path: str | Path) -> bool:
    """Throughput (output tokens per time bin, ~60 bins per run) and KV slots in use over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    width = max(0.5, max((r.wall_s for r in results), default=60.0) / 60)
    for r in results:
        bins: dict[int, int] = {}
        for t in r.turns:
            if t.error is None:
                bins[int(t.end_s // width)] = bins.get(int(t.end_s // width), 0) + t.completion_tokens
        xs = range(max(bins, default=0) + 1)
        ax1.plot([x * width for x in xs], [bins.get(x, 0) / width for x in xs], label=r.label)
        if r.kv_samples:
            ax2.plot([t for t, _ in r.kv_samples], [u for _, u in r.kv_samples], label=r.label)
    ax1.set_ylabel(f"output tok/s ({width:.3g} s bins)")
    ax2.set_ylabel("KV slots in use")
    ax2.set_xlabel("time since start (s)")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
