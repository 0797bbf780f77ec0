"""SnapKV window scores on the GPU: the Triton kernel vs the torch einsum, same inputs, one run.

    python3 benchmarks/window_scores_kernel.py [--keys 8192 32768 131072]

Per key count: llama3-8b shape per layer (32 query heads, 8 KV heads, head dim 128, bf16), window 32.
Checks that the kernel's per-head scores equal the torch path's (fp32, atol 1e-3 relative to the
window's total mass), then prints the time per layer and the peak extra memory of each, and the floor:
reading the keys once at the copy rate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_sparse.kernels.window_scores import window_scores_per_head  # noqa: E402
from sgl_sparse.methods.eviction.base import per_head_scores_torch  # noqa: E402


def timed(fn, reps: int = 10) -> tuple[float, float, torch.Tensor]:  # type: ignore[no-untyped-def]
    """(ms per call, peak extra MB, result)."""
    out = fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, (torch.cuda.max_memory_allocated() - base) / 2**20, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--hbm-tbps", type=float, default=4.3)
    args = p.parse_args()
    torch.manual_seed(0)
    w, heads, kv_heads, d = 32, 32, 8, 128
    print("| keys | torch ms/layer | triton ms/layer | speed-up | torch peak MB | triton peak MB | floor ms "
          "| max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in args.keys:
        q = torch.randn(w, heads, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, kv_heads, d, device="cuda", dtype=torch.bfloat16)
        k_pos = torch.arange(n, device="cuda") * 2  # every other position retained
        q_pos = torch.arange(2 * n - w, 2 * n, device="cuda")
        inputs = (q, k, q_pos, k_pos, d**-0.5)
        t_ms, t_mb, ref = timed(lambda: per_head_scores_torch(*inputs))  # noqa: B023 (called at once)
        k_ms, k_mb, got = timed(lambda: window_scores_per_head(*inputs))  # noqa: B023
        diff = float((got - ref).abs().max())
        if diff > 1e-3 * w * heads / kv_heads:
            raise SystemExit(f"kernel disagrees with torch at {n} keys: max abs diff {diff}")
        floor = n * kv_heads * d * 2 / (args.hbm_tbps * 1e12) * 1e3
        print(f"| {n} | {t_ms:.3f} | {k_ms:.3f} | {t_ms / k_ms:.2f} | {t_mb:.0f} | {k_mb:.0f} | {floor:.3f} | "
              f"{diff:.2e} |")


if __name__ == "__main__":
    main()
