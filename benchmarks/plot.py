"""Plot decode tok/s against batch size at ~130K context, vanilla FlashInfer beside each method.

Reads the measured points of ``benchmarks/results/decode_130k.csv`` (one row per run; ``#`` lines are comments)
and writes ``benchmarks/decode_130k.png``:

    python benchmarks/plot.py [--csv PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CSV = HERE / "results" / "decode_130k.csv"
DEFAULT_PNG = HERE / "decode_130k.png"

FAMILY_COLORS = {"vanilla": "black", "dense": "grey", "eviction": "tab:blue", "selection": "tab:orange",
                 "compression": "tab:red",
                 "quantization": "tab:green"}
MARKERS = "osD^v<>Ph*X"


@dataclass(frozen=True)
class Point:
    method: str
    family: str
    batch: int
    tok_s: float


def read_points(path: Path) -> list[Point]:
    """The CSV's rows, comment lines skipped."""
    with path.open(newline="") as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return [Point(r["method"], r["family"], int(r["batch"]), float(r["decode_tok_s"])) for r in rows]


def plot(points: list[Point], out: Path) -> None:
    """One line per method (its runs sorted by batch), coloured by family; vanilla's runs as one marker each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[Point]] = defaultdict(list)
    for p in points:
        by_method[p.method].append(p)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, (method, pts) in enumerate(by_method.items()):
        pts.sort(key=lambda p: p.batch)
        color = FAMILY_COLORS.get(pts[0].family, "tab:purple")
        label = method if method in ("vanilla", "dense") else f"{method} ({pts[0].family})"
        style = "none" if method == "vanilla" else "-"
        ax.plot([p.batch for p in pts], [p.tok_s for p in pts], linestyle=style, marker=MARKERS[i % len(MARKERS)],
                color=color, label=label, alpha=0.85)
    ax.set_xlabel("batch (concurrent requests of 130,000 prompt tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_yscale("log")
    ax.set_title("Decode throughput at 130K context, one H200 (llama3-8b shape)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Plot decode tok/s against batch at ~130K context.")
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--out", type=Path, default=DEFAULT_PNG)
    args = ap.parse_args(argv)
    plot(read_points(args.csv), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
