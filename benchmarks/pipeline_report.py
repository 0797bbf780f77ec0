"""Which loads of each served decode kernel's loop Triton's software pipeliner issues ahead, compiled for sm_90
without a GPU (as ``sass_counts.py``): for every load inside a loop, the pipeline stages by which it is issued ahead of
the loop's dots (0: the pipeliner left it in the stage that uses it, so the warp waits for it every iteration),
and the shared memory the kernel takes.

    python benchmarks/pipeline_report.py [--palu-tiles SPEC ...]

What decides it (Triton 3.6, ``AssignLatencies``): only loads that feed a dot's operands (directly or through
other ops, or through another load: an indirection level) are pipelined, and not those narrower than 32 bits a
copy (one fp16 a token, say); each gets ``(num_stages - 1) // (deepest level + 1)`` stages of lead, so every level
of indirection (a slot read from ``req_to_token``, then a position read at that slot, then a rotary row at that
position) divides the stages a kernel's data loads are issued ahead by. A loop with no dot pipelines nothing
unless it is a ``tl.range(..., num_stages=...)``. The measurements behind it: ``quant_decode.py`` on the GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import Any

from sass_counts import FP8_ARGS, KIVI_ARGS, OMNIKV_ARGS, PALU_ARGS, QUEST_ARGS, TQ_ARGS, _compile, palu_kernel

from sgl_sparse.kernels import (
    fp8_attention,
    kivi_attention,
    layer_sets,
    omnikv,
    palu_attention,
    quest,
    turboquant_attention,
)

STAGE = re.compile(r"loop\.stage = (\d+)")
LAYER_SETS_ARGS = dict(q="*bf16", k_cache="*bf16", v_cache="*bf16", req_to_token="*i32", req_pool_indices="*i64",
                       seq_lens="*i64", keep="*i32", count="*i32", tail="*i32", ws_m="*fp32", ws_l="*fp32",
                       ws_acc="*fp32", stride_qb="i32", stride_qh="i32", stride_ks="i32", stride_kh="i32",
                       stride_vs="i32", stride_vh="i32", stride_r2t="i32", stride_keep="i32", scale="fp32")


def _dump(fn: Any, args: dict[str, str], constants: dict[str, Any], warps: int, stages: int) -> tuple[str, int]:
    """The IR before Triton's pipeline pass (loads and dots carry ``loop.stage`` there) and the shared memory."""
    with tempfile.TemporaryFile(mode="w+") as err:
        saved = os.dup(2)
        os.environ["MLIR_ENABLE_DUMP"] = "1"
        os.dup2(err.fileno(), 2)
        try:
            compiled = _compile(fn, args, constants, warps, stages)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            del os.environ["MLIR_ENABLE_DUMP"]
        err.seek(0)
        text = err.read()
    start = text.rfind("IR Dump Before TritonGPUPipeline")
    end = text.find("IR Dump", start + 1)
    return text[start:end], compiled.metadata.shared


def _loop_leads(ir: str) -> list[list[int]]:
    """For each innermost ``scf.for``: the stages by which each load is issued ahead of the loop's last stage (its
    dots'); 0: issued in the stage that uses it, so waited on every iteration."""
    regions: list[int] = []  # open regions: a loop's index into ``loops``, or -1
    loops: list[tuple[list[int], list[int]]] = []  # (loads' stages, dots' stages)
    for line in ir.splitlines():
        s = line.strip()
        if s.startswith("}"):
            if regions:
                regions.pop()
            continue
        loop = next((r for r in reversed(regions) if r >= 0), -1)
        if loop >= 0 and (" = tt.load " in s or "dot " in s):
            m = STAGE.search(s)
            loops[loop][0 if " = tt.load " in s else 1].append(int(m.group(1)) if m else 0)
        if s.endswith("{"):
            regions.append(len(loops) if "scf.for" in s else -1)
            if "scf.for" in s:
                loops.append(([], []))
    return [[max(dots) - st for st in loads] for loads, dots in loops if loads and dots]


def report(label: str, fn: Any, args: dict[str, str], constants: dict[str, Any], warps: int, stages: int) -> None:
    ir, shared = _dump(fn, args, constants, warps, stages)
    leads = _loop_leads(ir)
    shown = "; ".join(" ".join(str(x) for x in loop) for loop in leads)
    waited = sum(x == 0 for loop in leads for x in loop)
    print(f"| {label} | {stages} | {shown} | {waited} | {shared // 1024} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--palu-tiles", nargs="*", default=[],
                   help="also Palu's kernel at these tiles (quant_decode.py's form)")
    a = p.parse_args()
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a kernel from Triton's cache is not compiled, so dumps nothing
    from quant_decode import palu_tile

    d, g = 128, 4
    print("| kernel | num_stages | each load's lead in stages over its loop's dots (loops apart by ;) | loads "
          "waited on every iteration | shared KB |")
    print("| --- | --- | --- | --- | --- |")
    for tile in [palu_attention.cuda_tile(d // 2), *(palu_tile(s) for s in a.palu_tiles)]:
        fn, consts = palu_kernel(tile, d, g)
        kind = "keys as rows" if tile.key_rows else "queries as rows"
        report(f"palu {tile.block} positions, {tile.warps} warps, angles {tile.angles}, {kind}", fn, PALU_ARGS, consts,
               tile.warps, tile.stages)
    ppi = kivi_attention.BLOCK_POSITIONS // 32
    for bits in (4, 2):
        key_rows, stages = kivi_attention.SERVED_LOOP.get(bits, (False, 2))
        for paired in (False, True):
            consts = dict(HKV=8, G=g, GP=g, D=d, GS=32, BITS=bits, PPI=ppi, NSPLIT=64, NATIVE=True, STACK=True,
                          PAIRED=paired)
            fn = kivi_attention._decode_kernel_key_rows if key_rows else kivi_attention._decode_kernel
            report(f"kivi{bits}, page 32{', scales paired' if paired else ''}", fn, KIVI_ARGS, consts, 2, stages)
    report("fp8_kv", fp8_attention._decode_kernel, FP8_ARGS,
           dict(HKV=8, G=g, GP=16, D=d, BLOCK=128, NSPLIT=64, NATIVE=True), 2, 2)
    report("turboquant 4-bit", turboquant_attention._decode_kernel, TQ_ARGS,
           dict(HKV=8, G=g, GP=g, D=d, LANE=4, BITS=4, NLEV=16, QJL=False, BLOCK=32, NSPLIT=64), 4, 3)
    report("pyramidkv layer sets", layer_sets._decode_kernel, LAYER_SETS_ARGS,
           dict(HKV=8, G=g, GP=16, D=d, BLOCK=64, NSPLIT=64, NATIVE=True), 4, 3)
    report("quest scores (tensor cores)", quest._score_kernel_mma, QUEST_ARGS,
           dict(stride_r2t=131076, HKV=8, GROUP=g, GP=16, D=d, PAGE=16, BLOCK_P=quest.BLOCK_PAGES, NPROG=16,
                IEEE=False), 4, 3)
    report("omnikv scores (tensor cores)", omnikv._score_tokens_kernel_mma, OMNIKV_ARGS,
           dict(HKV=8, G=g, GP=16, D=d, BLOCK=omnikv.BLOCK_TOKENS, PROGRAMS=64, IEEE=False), 4, 3)


if __name__ == "__main__":
    sys.exit(main())
