"""BENCHMARKS.md's rows and the plot's points from one GPU run's result files (``decode_throughput.py --json``),
so a device session's numbers land in the docs as measured, with the vanilla of the same run beside each:

    python benchmarks/bench_rows.py --gpu H200 --date 2026-12-07 --run 2026-12-07-device \\
        --notes 2026-12-07/NOTES.md RESULTS.json... [--csv] [--plot]

Prints one "Current results" row per method run (pairs as decode_throughput.py's tables: each against the vanilla
row of its run; a run without one is said to be so and gets no ratio); ``--csv`` appends the 130,000-token runs
(vanilla included) to ``benchmarks/results/decode_130k.csv``; ``--plot`` redraws ``benchmarks/decode_130k.png``
from that file (benchmarks/plot.py). ``--run``: the raw-output folder under benchmarks/results/; ``--notes``: the
file that describes it.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from decode_throughput import Result, _is_vanilla, _pairs, load_results

HERE = Path(__file__).resolve().parent
CSV = HERE / "results" / "decode_130k.csv"
HEADLINE_LEN = 130_000


def _method(r: Result) -> tuple[str, str, str]:
    """(name, family, config) of a row: ``vanilla`` for vanilla, else its ``--sparse-method`` and its family."""
    if _is_vanilla(r):
        return "vanilla", "vanilla", ""
    name, _, config = (r.config or r.server.removeprefix("sgl_sparse:")).partition(" ")
    from sgl_sparse.compose import family_label
    from sgl_sparse.registry import create_method

    try:
        family = family_label(create_method(name))
    except Exception:  # a method this checkout no longer registers: its row still prints
        family = "?"
    return name, family, config if config not in ("", "{}") else ""


def markdown_rows(results: list[Result], date: str, gpu: str, notes: str) -> list[str]:
    """Rows in BENCHMARKS.md's "Current results" columns."""
    rows = []
    paired = dict((id(r), base) for r, base in _pairs(results))
    link = f"[{date[5:]}](benchmarks/results/{notes})" if notes else "-"
    for r in results:
        if _is_vanilla(r):
            continue
        name, family, config = _method(r)
        base = paired.get(id(r))
        label = f"`{name}`" + (f" {config}" if config else "")
        mem = f"; `--mem-fraction-static {r.mem_fraction_static}`" if (
            base is not None and r.mem_fraction_static != base.mem_fraction_static) else ""
        if base is None or not _is_vanilla(base):
            vanilla, ratio = "no vanilla in this run", "-"
        else:
            vanilla = f"{base.decode_tok_s:,.1f} ({base.batch}), same run"
            ratio = f"**{r.decode_tok_s / base.decode_tok_s:.2f}x**" if base.decode_tok_s else "-"
        context = f"{r.input_len:,} in" if r.input_len else "?"
        rows.append(f"| {label} | {family} | {r.decode_tok_s:,.1f} ({r.batch}) at {context} | {vanilla} | {ratio} | "
                    f"{r.kv_tokens_in_use:,} of {r.kv_token_capacity:,} slots in use | {date}, {gpu}{mem} | "
                    f"{link} |")
    return rows


def csv_rows(results: list[Result], date: str, gpu: str, run: str, notes: str) -> list[list[str]]:
    """The 130,000-token runs as decode_130k.csv rows."""
    out = []
    for r in results:
        if r.input_len != HEADLINE_LEN:
            continue
        name, family, _ = _method(r)
        out.append([name, family, str(r.batch), f"{r.decode_tok_s:.1f}", date, gpu, run, notes])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", metavar="JSON")
    p.add_argument("--date", required=True)
    p.add_argument("--gpu", required=True, help="the GPU kind, e.g. H200 or H100")
    p.add_argument("--run", default="", help="the raw-output folder under benchmarks/results/")
    p.add_argument("--notes", default="", help="the file under benchmarks/results/ that describes the run")
    p.add_argument("--csv", action="store_true", help=f"append the {HEADLINE_LEN:,}-token runs to {CSV.name}")
    p.add_argument("--plot", action="store_true", help="redraw the plot from the CSV")
    args = p.parse_args()
    results = [r for f in args.results for r in load_results(f)]
    print("\n".join(markdown_rows(results, args.date, args.gpu, args.notes)))
    if args.csv:
        with CSV.open("a", newline="") as f:
            csv.writer(f).writerows(csv_rows(results, args.date, args.gpu, args.run, args.notes))
    if args.plot:
        import plot

        plot.main([])


if __name__ == "__main__":
    main()
