"""Summarise a server's torch-profiler trace of decode steps (``decode_throughput.py --profile-dir``).

Answers whether a decode step is GPU-bound and where its time goes: the GPU's busy time (the union of
kernel, copy and memset intervals) against the span of the profiled steps, the idle gaps between
them (the GPU waiting for the host), and the kernels by total time. A step count comes from the CUDA
graph launches (one per decode step under CUDA graphs).

    python benchmarks/profile_summary.py TRACE.trace.json.gz [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: Path) -> list[dict]:
    raw = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()
    with raw as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_union(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Total covered time and the gaps between covered stretches (microseconds)."""
    total, gaps, end = 0.0, [], None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total, gaps


def summarise(events: list[dict], top: int) -> str:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    lines: list[str] = []
    if not gpu:
        lines.append("no GPU events in this trace (was it recorded with activities CPU and GPU?)")
    else:
        lines += _gpu_lines(events, gpu, top)
    host: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in {"user_annotation", "python_function"}:
            host[e.get("name", "?")].append(float(e.get("dur", 0)))
    for title, keep in (("host range", lambda n: True), ("our host code (sgl_sparse)", lambda n: "sgl_sparse" in n)):
        rows = sorted(((n, d) for n, d in host.items() if keep(n)), key=lambda kv: -sum(kv[1]))[:top]
        if rows:  # python functions nest: a caller's total includes its callees
            lines += ["", f"| {title} | count | total ms | mean us |", "| --- | --- | --- | --- |"]
            lines += [f"| {n[-90:]} | {len(d)} | {sum(d) / 1e3:.2f} | {sum(d) / len(d):.1f} |" for n, d in rows]
    return "\n".join(lines)


def _gpu_lines(events: list[dict], gpu: list[dict], top: int) -> list[str]:
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    busy, gaps = busy_union(intervals)
    launches = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                and "GraphLaunch" in e.get("name", "")]
    steps = len(launches) or None
    lines = [f"GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({100 * busy / span:.1f}%), "
             f"idle {(span - busy) / 1e3:.2f} ms in {len(gaps)} gaps "
             f"({sum(g for g in gaps if g > 50) / 1e3:.2f} ms in {sum(g > 50 for g in gaps)} gaps over 50 us)"]
    if steps:
        lines.append(f"CUDA graph launches (decode steps): {steps}; per step: span {span / steps / 1e3:.2f} ms, "
                     f"GPU busy {busy / steps / 1e3:.2f} ms, idle {(span - busy) / steps / 1e3:.2f} ms")
    per: dict[str, list[float]] = defaultdict(list)
    for e in gpu:
        per[e.get("name", "?")].append(float(e.get("dur", 0)))
    lines += ["", "| GPU kernel / copy | count | total ms | mean us | share of busy |",
              "| --- | --- | --- | --- | --- |"]
    for name, durs in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {name[:90]} | {len(durs)} | {sum(durs) / 1e3:.2f} | {sum(durs) / len(durs):.1f} | "
                     f"{100 * sum(durs) / busy:.1f}% |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    for path in a.traces:
        print(f"## {path.name}\n")
        print(summarise(load(path), a.top))
        print()


if __name__ == "__main__":
    main()
