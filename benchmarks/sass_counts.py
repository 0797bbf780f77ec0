"""Instructions per KV element in the decode loops of KIVI's, TurboQuant's and FP8's Triton kernels (and in FP8's
prefix kernel at a few tiles, Quest's and OmniKV's scoring loops), compiled for sm_90
(the H100/H200) without a GPU: Triton's ``compile`` for a ``cuda`` target and the ``cuobjdump`` that Triton ships.

    python benchmarks/sass_counts.py [--warps W] [--gp GP] [--head-dim 128] [--group 4] [--page 32] [--stages 2]

For each kernel at Llama-3-8B heads (8 KV heads, a group of 4, 128 dims; KIVI's page 32, both forms of its loop:
queries or keys as the dots' rows; TurboQuant's 32 positions an iteration): registers, spills (stack bytes), and
the loop body's SASS instructions x threads / (positions x D x 2) elements, in total and by kind (integer, float,
tensor-core, global and shared memory, shuffles). This counts work, it does not time it: an instruction's cost
depends on its pipe (integer ops run at half the float rate) and the loop's stalls; ``quant_decode.py`` on the GPU
is the measurement. Arguments are taken 16-divisible, as the JIT specializes them. The kernels' warps and
query-row padding (``--warps``, ``--gp``) default to what their ``decode_attention`` uses. Run with ``PYTHONPATH``
at another checkout to count its kernels (a kernel with ``BITS`` instead of ``LANE`` is the bit-plane one; it used
``--gp 16 --warps 4``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sgl_sparse.kernels import fp8_attention, kivi_attention, omnikv, palu_attention, quest, turboquant_attention

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
KINDS = {
    "int": ("LOP3", "SHF", "IADD3", "IMAD", "ISETP", "LEA", "PRMT", "SEL", "SGXT", "MOV", "VIADD", "IABS", "I2FP"),
    "float": ("FADD", "FMUL", "FFMA", "FSETP", "FMNMX", "FSEL", "MUFU", "HADD2", "HFMA2", "HMUL2"),
    "mma": ("HMMA",),
    "global": ("LDG", "STG", "LDGSTS"),
    "shared": ("LDS", "STS", "LDSM", "STSM"),
    "shuffle": ("SHFL",),
}
KIVI_ARGS = dict(q="*bf16", k_codes="*u8", v_codes="*u8", k_scale="*fp16", k_zero="*fp16", v_scale="*fp16",
                 v_zero="*fp16", res_k="*bf16", res_v="*bf16", req_to_token="*i32", req_pool_indices="*i64",
                 seq_lens="*i64", ws_m="*fp32", ws_l="*fp32", ws_acc="*fp32", stride_qb="i32", stride_qh="i32",
                 stride_cs="i32", stride_ch="i32", stride_ksp="i32", stride_ksh="i32", stride_vss="i32",
                 stride_vsh="i32", stride_rr="i32", stride_rt="i32", stride_rh="i32", stride_r2t="i32", scale="fp32")
QUEST_ARGS = dict(q="*bf16", kmin="*bf16", kmax="*bf16", req_to_token="*i32", req_pool_indices="*i64",
                  seq_lens="*i64", scores="*fp32", max_pages="i32", sink_pages="i32", recent_pages="i32")
OMNIKV_ARGS = dict(q="*bf16", k_cache="*bf16", req_to_token="*i32", req_pool_indices="*i64", seq_lens="*i64",
                   out="*fp32", stride_qb="i32", stride_qh="i32", stride_ks="i32", stride_kh="i32", stride_r2t="i32",
                   stride_out="i32", sink="i32", recent="i32")
TQ_ARGS = dict(q_rot="*fp32", q_proj="*fp32", k_codes="*u8", v_codes="*u8", k_norm="*fp32", v_norm="*fp32",
               k_signs="*u8", k_rnorm="*fp32", unit_levels="*fp32", req_to_token="*i32", req_pool_indices="*i64",
               seq_lens="*i64", ws_m="*fp32", ws_l="*fp32", ws_acc="*fp32", stride_r2t="i32", scale="fp32",
               qjl_scale="fp32")

FP8_ARGS = dict(q="*bf16", k_codes="*u8", k_scale="*fp32", v_codes="*u8", v_scale="*fp32", req_to_token="*i32",
                req_pool_indices="*i64", seq_lens="*i64", ws_m="*fp32", ws_l="*fp32", ws_acc="*fp32",
                stride_qb="i32", stride_qh="i32", stride_cs="i32", stride_ch="i32", stride_ss="i32",
                stride_r2t="i32", scale="fp32")
FP8_PREFIX_ARGS = dict(q="*bf16", k_codes="*u8", k_scale="*fp32", v_codes="*u8", v_scale="*fp32",
                       qo_indptr="*i32", req_to_token="*i32", req_pool_indices="*i64", prefix_lens="*i32",
                       blk_req="*i32", blk_start="*i32", out="*bf16", lse="*fp32", stride_qt="i32", stride_qh="i32",
                       stride_ot="i32", stride_oh="i32", stride_cs="i32", stride_ch="i32", stride_ss="i32",
                       stride_r2t="i32", scale="fp32")
PALU_ARGS = dict(q="*bf16", zk="*bf16", zv="*bf16", pos_buf="*i32", bk="*bf16", cos_sin="*fp16",
                 req_to_token="*i32", req_pool_indices="*i64", seq_lens="*i64", ws_m="*fp32", ws_l="*fp32",
                 ws_acc="*fp32", stride_qb="i32", stride_qh="i32", stride_zks="i32", stride_zkg="i32",
                 stride_zvs="i32", stride_zvg="i32", stride_bkg="i32", stride_bkd="i32", stride_cs="i32",
                 stride_r2t="i32", scale="fp32")


def _compile(fn: Any, args: dict[str, str], constants: dict[str, Any], warps: int, stages: int = 2) -> Any:
    constants = {k: v for k, v in constants.items() if k in fn.arg_names}
    sig = {name: "constexpr" if name in constants else args[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constants and (args[name].startswith("*") or args[name] == "i32")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def _loop_body(sass: str) -> list[str]:
    """Opcodes of the first loop (from a backward branch's target to the branch): the decode's page loop."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)[^;]*?(0x[0-9a-f]+)?\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    for addr, op, target in ins:
        if op == "BRA" and target and int(target, 16) < addr:
            return [o for a, o, _ in ins if int(target, 16) <= a <= addr]
    raise ValueError("no loop found")


def count(label: str, fn: Any, args: dict[str, str], constants: dict[str, Any], warps: int, elements: int,
          stages: int = 2) -> None:
    c = _compile(fn, args, constants, warps, stages)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", f.name], capture_output=True, text=True).stdout
    body = _loop_body(sass)
    per = warps * 32 / elements
    kinds: collections.Counter[str] = collections.Counter()
    for op in body:
        kinds[next((k for k, ops in KINDS.items() if op.startswith(ops)), "other")] += 1
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    by_kind = ", ".join(f"{k} {n * per:.2f}" for k, n in sorted(kinds.items(), key=lambda x: -x[1]))
    print(f"| {label} | {regs and regs.group(1)} | {stack and stack.group(1)} | {len(body) * per:.2f} | {by_kind} |",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warps", type=int, help="default: the kernels' own (KIVI 2 at a 32-slot page, TurboQuant 4)")
    p.add_argument("--gp", type=int, help="query rows a tile (default: the group padded to a power of two)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--page", type=int, default=32, help="KIVI's page (group) size")
    p.add_argument("--pages", type=int, help="KIVI's pages an iteration (default: its decode_attention's)")
    p.add_argument("--stages", type=int, default=2, help="KIVI's pipeline stages (its decode_attention's: 2)")
    p.add_argument("--palu-tiles", nargs="*", default=[],
                   help="Palu's kernel at these tiles only (quant_decode.py's --palu-tiles form; rank ratio 0.5), "
                        "its served tile first")
    a = p.parse_args()
    d, g = a.head_dim, a.group
    gp = a.gp or triton.next_power_of_2(g)
    print("| kernel | registers | stack | instructions / element | by kind |")
    print("| --- | --- | --- | --- | --- |")
    if a.palu_tiles:
        _palu(d, g, a.palu_tiles)
        return
    ppi = max(1, 16 // a.page, a.pages or (kivi_attention.BLOCK_POSITIONS // a.page if a.page >= 16 else 1))
    stack = ppi > 1 and a.page >= 16  # as kivi_attention.decode_attention decides, warps too
    for bits in (4, 2):
        consts = dict(HKV=8, G=g, GP=gp, D=d, GS=a.page, BITS=bits, PPI=ppi, NSPLIT=64, NATIVE=True, STACK=stack,
                      PAIRED=False)
        for label, fn in ((f"kivi{bits}", kivi_attention._decode_kernel),
                          (f"kivi{bits} key rows", kivi_attention._decode_kernel_key_rows)):
            count(label, fn, KIVI_ARGS, consts, a.warps or (2 if stack else max(2, ppi * a.page // 16)),
                  ppi * a.page * d * 2, a.stages)
    for bits, qjl in ((4, False), (3, False), (2, False), (4, True)):
        lane = 4 if bits == 3 else bits
        consts = dict(HKV=8, G=g, GP=gp, D=d, LANE=lane, BITS=bits, NLEV=2**bits, QJL=qjl, BLOCK=32, NSPLIT=64)
        count(f"turboquant{bits}{' + qjl' if qjl else ''}", turboquant_attention._decode_kernel, TQ_ARGS, consts,
              a.warps or 4, 32 * d * 2)
    # FP8's decode loop (as served: 128 positions an iteration, 2 warps) and its prefix kernel's at a few tiles
    # (BLOCK_M query tokens x the group's heads a program, BLOCK_N positions an iteration; served: 32 x 64, 8 warps).
    fc = dict(HKV=8, G=g, GP=max(16, gp), D=d, BLOCK=128, NSPLIT=64, NATIVE=True)
    for stages in (2, 3):
        count(f"fp8_kv decode, {stages} stages", fp8_attention._decode_kernel, FP8_ARGS, fc, a.warps or 2,
              128 * d * 2, stages)
    for bm, bn, warps, stages in ((32, 64, 8, 2), (32, 64, 8, 3), (32, 128, 8, 2), (32, 64, 4, 2), (16, 64, 4, 2)):
        pc = dict(HQ=8 * g, G=g, GP=gp, D=d, BLOCK_M=bm, BLOCK_N=bn, NATIVE=True)
        count(f"fp8_kv prefix {bm}x{bn}, {warps} warps, {stages} stages", fp8_attention._prefix_kernel,
              FP8_PREFIX_ARGS, pc, warps, bn * d * 2, stages)
    # The selection methods' scoring loops (an element: a page summary's entry, min or max; a key's): the served
    # CUDA-core kernels and their tensor-core forms (score_pages / score_tokens with mma=True), 4 warps as served.
    qc = dict(stride_r2t=131076, HKV=8, GROUP=g, D=d, PAGE=16, BLOCK_P=quest.BLOCK_PAGES, NPROG=16)
    count("quest scores", quest._score_kernel, QUEST_ARGS, qc, 4, quest.BLOCK_PAGES * d * 2)
    count("quest scores, tensor cores", quest._score_kernel_mma, QUEST_ARGS,
          dict(qc, GP=max(16, triton.next_power_of_2(g)), IEEE=False), 4, quest.BLOCK_PAGES * d * 2)
    oc = dict(HKV=8, G=g, D=d, BLOCK=omnikv.BLOCK_TOKENS, PROGRAMS=64)
    count("omnikv scores", omnikv._score_tokens_kernel, OMNIKV_ARGS, oc, 4, omnikv.BLOCK_TOKENS * d * 8)
    count("omnikv scores, tensor cores", omnikv._score_tokens_kernel_mma, OMNIKV_ARGS,
          dict(oc, GP=max(16, triton.next_power_of_2(g)), IEEE=False), 4, omnikv.BLOCK_TOKENS * d * 8)


def _palu(d: int, g: int, specs: list[str]) -> None:
    """Palu's decode loop at rank ratio 0.5 (a rank of d / 2 for keys and values): an element is a reconstructed
    key's or value's (``block x d x 2`` a tile), as the quantized kernels count theirs."""
    from quant_decode import palu_tile

    for tile in [palu_attention.cuda_tile(d // 2), *(palu_tile(s) for s in specs)]:
        fn, consts = palu_kernel(tile, d, g)
        count(f"palu {tile}", fn, PALU_ARGS, consts, tile.warps, tile.block * d * 2, tile.stages)


def palu_kernel(tile: palu_attention.Tile, d: int, g: int) -> tuple[Any, dict[str, Any]]:
    """Palu's decode kernel at ``tile`` and its compile-time constants at rank ratio 0.5 (8 KV heads of ``d``, a group
    of ``g``; int32 offsets)."""
    r = d // 2
    consts = dict(HKV=8, GS=1, G=g, GP=max(tile.query_rows, g), D=d, HALF=d // 2, NEOX=True, RK=r, RKP=r, RV=r,
                  RVP=r, BLOCK=tile.block, NSPLIT=64, NATIVE=True, I32=True, ANGLES=tile.angles,
                  JC=tile.freq_chunk or d // 2, GSTAGES=palu_attention.gather_stages(tile))
    return (palu_attention._decode_kernel_key_rows if tile.key_rows else palu_attention._decode_kernel), consts


if __name__ == "__main__":
    main()
