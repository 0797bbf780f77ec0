"""Extend attention over a quantized prefix on the GPU (no server): one layer of a chunked prefill's last chunk,
the part where the chunk's queries read the cached prefix, as vanilla FlashInfer reads its bf16 pool and as our
stores read theirs.

    python benchmarks/quant_prefill.py [--shapes 16384x114000 16384x16384] [--methods fp8_kv kivi4 turboquant]
                                       [--fp8-tiles 32x64x8x0 32x128x8x3 ...]

A shape is NEWxPREFIX: NEW query tokens (SGLang's chunk, 16,384 by default) of one request over PREFIX cached
tokens (114,000: the last chunk of a 130K prompt; the served 130K runs' prefill logs show FP8 2.4x slower than
vanilla there, BENCHMARKS.md). Llama-3-8B heads (32 query heads, 8 KV heads, dim 128), bf16 queries, a pool of
random codes with small scales (timing does not depend on them), the prefix's slots contiguous. Rows:

* ``vanilla bf16 (FlashInfer paged, page 1)``: what SGLang's FlashInfer backend runs for this part
  (``BatchPrefillWithPagedKVCacheWrapper``, non-causal over the prefix, page size 1);
* ``<method> (Triton prefix kernel)``: the store's CUDA ``prefix`` (what our server runs today);
  ``--fp8-tiles BMxBNxWARPSxSTAGES``: FP8's kernel at those tiles (BM query tokens a program, BN positions an
  iteration, STAGES 0 = Triton's default);
* ``<method> (dequantize + FlashInfer ragged)``: the stores' ``prefix_attention: "dequantize"``: the prefix's K/V
  dequantized into a bf16 buffer (``store.read_prefix``), then FlashInfer's ragged prefill over it; the
  dequantization's own time beside it.

Columns: microseconds a layer (CUDA events, the median of ``--iters`` after two warm-up calls), the ratio to
vanilla, the achieved TFLOP/s (4 * NEW * PREFIX * 32 heads * 128 FLOPs a layer), and the largest deviation from the
store's torch path (the CPU server's, the tests' reference) over the first 64 queries, relative to its largest
value.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
from quant_decode import fill_pool

from sgl_sparse.contract import KVGeometry
from sgl_sparse.kernels import fp8_attention
from sgl_sparse.registry import create_method
from sgl_sparse.rules import pool_page_size

HQ, HKV, D = 32, 8, 128
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "kivi4": ("kivi", {"bits": 4}),
    "kivi2": ("kivi", {"bits": 2}),
    "fp8_kv": ("fp8_kv", {}),
    "turboquant": ("turboquant", {}),
}
CHECK_Q = 64  # queries the error column compares (the torch path's logits grow as queries x prefix)


def _time_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


class Case:
    """One store holding one request's prefix, and the extend's lists."""

    def __init__(self, label: str, new: int, prefix: int) -> None:
        name, config = METHODS[label]
        method = create_method(name, config)
        self.store: Any = method.store
        assert self.store is not None
        ps = max(1, pool_page_size(method))
        width = -(-(prefix + new) // ps) * ps
        g = KVGeometry(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=ps,
                       num_slots=width + ps, dtype=torch.bfloat16, device=torch.device("cuda"), max_requests=2)
        self.store.allocate(g)
        self.store.use_triton = True
        fill_pool(self.store)
        self.r2t = torch.zeros(2, width, dtype=torch.int32, device="cuda")
        self.r2t[1] = (torch.arange(width, device="cuda") + ps).int()  # page 0: SGLang's padding page
        self.rpi = torch.ones(1, dtype=torch.int64, device="cuda")
        self.prefix_lens = torch.tensor([prefix], dtype=torch.int32, device="cuda")
        self.q = torch.randn(new, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.scale = 1 / math.sqrt(D)
        self.new, self.prefix = new, prefix

    def run(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qo = torch.tensor([0, q.shape[0]], dtype=torch.int32, device="cuda")
        return self.store.prefix(0, q, qo, self.r2t, self.rpi, self.prefix_lens, [q.shape[0]], self.scale)

    def reference(self) -> torch.Tensor:
        self.store.use_triton = False
        try:
            return self.run(self.q[:CHECK_Q])[0].float()
        finally:
            self.store.use_triton = True

    def flops(self) -> float:
        return 4.0 * self.new * self.prefix * HQ * D


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-6))


def _row(config: str, us: float, vanilla_us: float | None, flops: float, err: float | None, note: str = "") -> str:
    ratio = f"{us / vanilla_us:.2f}" if vanilla_us else "1"
    e = f"{err:.1e}" if err is not None else ""
    return f"| {config} | {us:.0f} | {ratio} | {flops / us / 1e6:.0f} | {e} | {note} |"


def _vanilla(new: int, prefix: int, iters: int) -> float:
    """FlashInfer's paged prefill over a bf16 pool (page size 1), non-causal over the prefix: SGLang's paged part."""
    import flashinfer

    k = torch.randn(prefix, 1, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(new, HQ, D, device="cuda", dtype=torch.bfloat16)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(torch.tensor([0, new], dtype=torch.int32, device="cuda"),
           torch.tensor([0, prefix], dtype=torch.int32, device="cuda"),
           torch.arange(prefix, dtype=torch.int32, device="cuda"), torch.ones(1, dtype=torch.int32, device="cuda"),
           HQ, HKV, D, 1, causal=False, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return _time_us(lambda: w.run(q, (k, v), return_lse=True), iters)


def _dequantized(case: Case, iters: int) -> tuple[float, float, float]:
    """(dequantize us, FlashInfer ragged us, max error): the prefix read through ``store.read_prefix`` into bf16
    (what ``prefix_attention: dequantize`` reads), then FlashInfer's ragged prefill over it."""
    import flashinfer

    slots = case.r2t[1, : case.prefix].long()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")

    def plan(n: int) -> None:
        w.plan(torch.tensor([0, n], dtype=torch.int32, device="cuda"),
               torch.tensor([0, case.prefix], dtype=torch.int32, device="cuda"), HQ, HKV, D, causal=False,
               q_data_type=torch.bfloat16, sm_scale=case.scale)

    def read() -> tuple[torch.Tensor, torch.Tensor]:
        return case.store.read_prefix(0, case.r2t, case.rpi, case.prefix_lens, [case.prefix], slots)

    deq_us = _time_us(read, iters)
    k, v = read()
    plan(CHECK_Q)
    err = _err(w.run(case.q[:CHECK_Q], k, v), case.reference())
    plan(case.new)
    attn_us = _time_us(lambda: w.run(case.q, k, v, return_lse=True), iters)
    return deq_us, attn_us, err


def _method_rows(label: str, new: int, prefix: int, vanilla: float, tiles: list[str], iters: int) -> None:
    """The store's prefix kernel and its dequantize + FlashInfer path; for FP8 also the kernel's tiles."""
    case = Case(label, new, prefix)
    flops = case.flops()
    want = case.reference()
    us = _time_us(lambda: case.run(case.q), iters)
    err = _err(case.run(case.q[:CHECK_Q])[0], want)
    print(_row(f"{new} over {prefix}: {label} (Triton prefix kernel)", us, vanilla, flops, err), flush=True)
    deq, attn, err = _dequantized(case, iters)
    print(_row(f"{new} over {prefix}: {label} (dequantize + FlashInfer ragged)", deq + attn, vanilla, flops, err,
               f"dequantize {deq:.0f} us + attention {attn:.0f} us"), flush=True)
    if label != "fp8_kv":
        return
    s = case.store
    for tile in tiles:
        bm, bn, warps, stages = (int(x) for x in tile.split("x"))

        def call(q: torch.Tensor, bm: int = bm, bn: int = bn, warps: int = warps,
                 stages: int = stages) -> tuple[torch.Tensor, torch.Tensor]:
            qo = torch.tensor([0, q.shape[0]], dtype=torch.int32, device="cuda")
            return fp8_attention.prefix_attention(
                q, s.k_codes[0], s.k_scale[0], s.v_codes[0], s.v_scale[0], qo, case.r2t, case.rpi,
                case.prefix_lens, case.scale, [q.shape[0]], block_m=bm, block_n=bn, warps=warps,
                stages=stages or None)

        try:
            us = _time_us(lambda call=call: call(case.q), iters)
            err = _err(call(case.q[:CHECK_Q])[0], want)
            print(_row(f"{new} over {prefix}: fp8_kv kernel {tile}", us, vanilla, flops, err), flush=True)
        except Exception as e:  # a tile that does not compile (shared memory): say so, go on
            print(f"| {new} over {prefix}: fp8_kv kernel {tile} | failed: {type(e).__name__}: {str(e)[:120]} "
                  "| | | | |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16384x114000", "16384x16384"], help="NEWxPREFIX")
    p.add_argument("--methods", nargs="+", default=["fp8_kv", "kivi4", "turboquant"], choices=list(METHODS))
    p.add_argument("--fp8-tiles", nargs="*", default=["32x64x8x0", "32x128x8x0", "32x64x4x3", "32x128x8x3",
                                                       "16x64x4x3"],
                   help="FP8's prefix kernel also at these BMxBNxWARPSxSTAGES (BM query tokens a program)")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    print("| config | us/layer | ratio to vanilla | TFLOP/s | max error / max of the torch path | note |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        new, prefix = (int(x) for x in shape.split("x"))
        vanilla = _vanilla(new, prefix, args.iters)
        flops = 4.0 * new * prefix * HQ * D
        print(_row(f"{new} over {prefix}: vanilla bf16 (FlashInfer paged, page 1)", vanilla, None, flops, None),
              flush=True)
        for label in args.methods:
            _method_rows(label, new, prefix, vanilla, args.fp8_tiles if label == "fp8_kv" else [], args.iters)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
