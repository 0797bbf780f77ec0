"""Decode attention over the quantized and low-rank KV pools on the GPU (no server): one layer's decode (the
store's CUDA path: KIVI 2/4-bit, FP8, TurboQuant, Palu at rank ratio 0.5 and 0.75, each through its Triton
kernel and the splits' merge, TurboQuant with its torch rotations) replayed as a CUDA graph, as inside a served
decode step, beside the bytes its pool holds for the batch's tokens (Palu: plus its factors), the time to read
them at the HBM rate, and the same for a bf16 pool (what vanilla reads). ``bf16 (FlashInfer)``: vanilla's decode
kernel (FlashInfer's paged decode, tensor cores, page size 1) over a bf16 pool of the same tokens, timed the same
way (planned once, the run replayed as a CUDA graph).

    python benchmarks/quant_decode.py [--shapes 6x130000 16x32768] [--methods kivi4 kivi2 fp8_kv turboquant palu
                                      palu75 flashinfer] [--warps 2 4]

Llama-3-8B heads (32 query heads, 8 KV heads, dim 128), bf16 queries, rows 131,076 wide as in a server at
``--context-length 131072`` (SGLang adds 4; the grid, its splits included, follows the width, as a graph
captured for the context length does). ``step ms`` is 32 layers of it: the attention part of a decode step.
Pool contents are random codes with small scales: timing does not depend on them. ``--warps``: also time
the kernels at these warp counts (their ``decode_attention(..., warps=)``; the default rows use the kernels' own
choice), one row each; ``--fp8-blocks`` / ``--tq-blocks`` / ``--kivi-pages``: FP8's and TurboQuant's kernels at
these positions an iteration, KIVI's at these pages (x each of ``--warps``); ``--palu-tiles``: Palu's at these
``BLOCKxWARPSxSTAGES[xMAXNREG[xCHUNK[xROWS[xANGLES[xKEYROWS[xSPLITS]]]]]]`` (``palu_attention.Tile``'s fields);
``--kivi-tiles``: KIVI's at these ``PAGESxWARPSxSTAGES[xMAXNREG[xKEYROWS[xPAIRED]]]`` (0: the default; KEYROWS 1:
its keys-as-rows loop, ``decode_attention(..., key_rows=True)``: ``0x0x0x0x1`` is that loop at the default tile;
PAIRED 1: a token's value scales and zeros in one load, ``paired_scales=True``);
``--palu-fp32``: also Palu's kernel with fp32 dots and rotary table (its interpreter form).
The last column: the kernel's largest deviation from the store's
torch path (the CPU server's decode, the tests' reference) on the same pool, relative to that output's largest
value.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from graph_timing import graph_us_after_eviction

from sgl_sparse.contract import AttentionProjections, KVGeometry, KVStore, ModelKV, RotaryTable
from sgl_sparse.kernels import fp8_attention, kivi_attention, palu_attention, turboquant_attention
from sgl_sparse.registry import create_method
from sgl_sparse.rules import pool_page_size

HQ, HKV, D, LAYERS, HIDDEN = 32, 8, 128, 32, 4096
WIDTH = 131072 + 4  # SGLang's req_to_token rows: the context length (Llama-3-8B's) + 4
HBM = 4.3e12  # bytes/s, the nominal copy rate BENCHMARKS.md's floors use
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "kivi4": ("kivi", {"bits": 4}),
    "kivi2": ("kivi", {"bits": 2}),
    "fp8_kv": ("fp8_kv", {}),
    "turboquant": ("turboquant", {}),
    "palu": ("palu", {"rank_ratio": 0.5}),
    "palu75": ("palu", {"rank_ratio": 0.75}),
}
FLASHINFER = "flashinfer"


def llama3_model_kv() -> ModelKV:
    """One layer of random K/V projections of Llama-3-8B's shape and its rotary table (theta 500,000, the
    context length's positions): what Palu factors at a server's start."""
    gen = torch.Generator().manual_seed(0)
    layer = AttentionProjections(torch.randn(HKV * D, HIDDEN, generator=gen) / math.sqrt(HIDDEN),
                                 torch.randn(HKV * D, HIDDEN, generator=gen) / math.sqrt(HIDDEN))
    inv = 1.0 / 500_000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.arange(WIDTH, dtype=torch.float64)[:, None] * inv[None, :]
    table = torch.cat([f.cos(), f.sin()], dim=-1).float()
    return ModelKV((layer,), HKV, D, D, RotaryTable(table, D, True))


def fill_pool(store: object) -> None:
    """Random codes in every uint8 buffer, 0.05 in the scales elsewhere (zeros would decode to a constant row);
    Palu: random latents (positions: ``_row`` writes them as served), its factors as computed."""
    for name, value in vars(store).items():
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            for t in value:
                if t.dtype == torch.uint8:
                    t.random_(0, 256)
                    t[(t & 0x7F) == 0x7F] = 0  # no E4M3 NaN codes (the check against the torch path)
                elif name in ("zk", "zv"):
                    t.normal_(0, 0.5)  # Palu's latents: coordinates in its bases
                elif t.is_floating_point() and t.dim() >= 2 and name not in ("k_basis", "v_basis"):
                    t.fill_(0.05)  # small: a softmax that is not one-hot, so the check below means something


def _decode(label: str, store: Any, knobs: dict[str, Any]) -> Callable[..., torch.Tensor]:
    """The store's CUDA decode, or its kernel called with ``knobs`` (its ``decode_attention``'s keyword arguments:
    Palu's ``tile`` and ``native``, KIVI's ``pages``/``warps``/``stages``/``maxnreg``/``key_rows``, FP8's
    ``block``/``warps``/``stages``, TurboQuant's ``block``/``warps``); Palu's fp32 form (``native`` False) reads the
    fp32 rotary table, a tile whose angles go by row index its mirrored form."""
    if not knobs:
        return store.decode
    if label.startswith("palu"):
        rot = store.rotary
        table = store.kernel_cos_sin if knobs.get("native", True) else rot.cos_sin
        if "tile" in knobs:
            table = palu_attention.table_for(knobs["tile"], table)
        return lambda layer, q, *rest: palu_attention.decode_attention(
            q, store.zk[layer], store.zv[layer], store.pos[layer], store.k_basis[layer], store.v_basis[layer], table,
            rot.neox, *rest, **knobs)
    if label == "fp8_kv":
        return lambda layer, q, *rest: fp8_attention.decode_attention(
            q, store.k_codes[layer], store.k_scale[layer], store.v_codes[layer], store.v_scale[layer], *rest, **knobs)
    if label.startswith("kivi"):
        return lambda layer, q, *rest: kivi_attention.decode_attention(q, *store._buffers(layer), *rest, store.bits,
                                                                        store.group, **knobs)
    return lambda layer, q, *rest: turboquant_attention.decode_attention(q, store.layer(layer), *rest, **knobs)


def _describe(label: str, knobs: dict[str, Any]) -> str:
    """The row's label: the method and the knobs that differ from its kernel's defaults."""
    tile = knobs.get("tile")
    parts = []
    if tile is not None:
        default = palu_attention.Tile(block=tile.block)
        parts = [f"{v} {k}" if not isinstance(v, bool) else k for k, v in tile._asdict().items()
                 if k == "block" or v != getattr(default, k)]
    parts += [k if v is True else f"{v} {k}" for k, v in knobs.items() if k not in ("tile", "native") and v]
    if knobs.get("native") is False:
        parts.append("fp32 dots and table")
    return f"{label} ({', '.join(parts)})" if parts else label


def _row(label: str, bs: int, n: int, knobs: dict[str, Any] | None = None, evict_mb: int = 0) -> str:
    knobs = knobs or {}
    name, config = METHODS[label]
    method = create_method(name, config)
    store = method.store
    assert store is not None
    if store.needs_model:
        store.load_model(llama3_model_kv())
    ps = max(1, pool_page_size(method))
    row_slots = -(-WIDTH // ps) * ps  # each request in its own whole pages
    slots = bs * row_slots + ps  # page 0 is SGLang's padding page
    g = KVGeometry(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=ps, num_slots=slots,
                   dtype=torch.bfloat16, device=torch.device("cuda"), max_requests=bs + 1)
    store.allocate(g)
    fill_pool(store)
    for t in getattr(store, "pos", []):  # Palu's positions as served: a row's t-th slot holds position t
        t.copy_(((torch.arange(slots, device="cuda") - ps) % row_slots).clamp(max=WIDTH - 1))
    r2t = torch.zeros(bs + 1, WIDTH, dtype=torch.int32, device="cuda")
    r2t[1:] = (torch.arange(bs, device="cuda")[:, None] * row_slots + torch.arange(WIDTH, device="cuda") + ps).int()
    rpi = torch.arange(1, bs + 1, device="cuda")
    seq = torch.full((bs,), n, device="cuda")
    q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    decode = _decode(label, store, knobs)
    us = graph_us_after_eviction(lambda: decode(0, q, r2t, rpi, seq, scale), evict_mb, iters=20, warmup=3)
    # The kernel against the store's torch path (the CPU server's, the tests' reference) on the same pool.
    got = decode(0, q, r2t, rpi, seq, scale).float()
    if name == "palu":  # the contract's torch default: read (reconstruct), then attend
        want = KVStore.decode(store, 0, q, r2t, rpi, seq, scale).float()
    else:
        store.use_triton = False
        want = store.decode(0, q, r2t, rpi, seq, scale).float()
        store.use_triton = True
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
    pool = bs * n * store.bytes_per_token(g)  # one layer's bytes for the batch's tokens
    # what every step reads once, whatever the batch: Palu's factors
    pool += sum(b.numel() * b.element_size() for b in getattr(store, "k_basis", []) + getattr(store, "v_basis", []))
    bf16 = bs * n * 2 * HKV * D * 2
    floor, bf16_floor = pool / HBM * 1e6, bf16 / HBM * 1e6
    label = _describe(label, knobs)
    return (f"| {label} | {bs} x {n} | {us:.0f} | {us * LAYERS / 1000:.2f} | {pool / 1e6:.0f} | {floor:.0f} | "
            f"{floor / us * 100:.0f}% | {bf16 / 1e6:.0f} | {bf16_floor:.0f} | {bf16_floor / us:.2f} | {err:.1e} |")


def _flashinfer_row(bs: int, n: int, evict_mb: int = 0) -> str:
    """Vanilla's decode: FlashInfer's paged decode (tensor cores, NHD, page size 1) over a bf16 pool."""
    import flashinfer

    dev = torch.device("cuda")
    k = torch.randn(bs * n + 1, 1, HKV, D, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(bs, HQ, D, dtype=torch.bfloat16, device=dev)
    workspace = torch.empty(384 * 1024 * 1024, dtype=torch.uint8, device=dev)
    indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * n
    indices = torch.arange(bs * n, dtype=torch.int32, device=dev) + 1  # slot 0: SGLang's padding slot
    last = torch.ones(bs, dtype=torch.int32, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True,
                                                            use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                                                            paged_kv_indices_buffer=indices,
                                                            paged_kv_last_page_len_buffer=last)
    wrapper.plan(indptr, indices, last, HQ, HKV, D, 1, data_type=torch.bfloat16, q_data_type=torch.bfloat16)
    us = graph_us_after_eviction(lambda: wrapper.run(q, (k, v)), evict_mb, iters=20, warmup=3)
    bf16 = bs * n * 2 * HKV * D * 2
    floor = bf16 / HBM * 1e6
    return (f"| bf16 (FlashInfer) | {bs} x {n} | {us:.0f} | {us * LAYERS / 1000:.2f} | {bf16 / 1e6:.0f} | "
            f"{floor:.0f} | {floor / us * 100:.0f}% | {bf16 / 1e6:.0f} | {floor:.0f} | {floor / us:.2f} | - |")


def palu_tile(spec: str) -> palu_attention.Tile:
    """``--palu-tiles``' form (:func:`palu_attention.parse_tile`) as a Tile."""
    try:
        return palu_attention.parse_tile(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--palu-tiles {e}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["6x130000", "16x32768"], help="BATCHxCONTEXT")
    p.add_argument("--methods", nargs="+", default=[*METHODS, FLASHINFER], choices=[*METHODS, FLASHINFER])
    p.add_argument("--warps", nargs="*", type=int, default=[], help="also time the kernels at these warps")
    p.add_argument("--fp8-blocks", nargs="*", type=int, default=[],
                   help="also time FP8's kernel at these positions an iteration (x each of --warps, if any)")
    p.add_argument("--kivi-pages", nargs="*", type=int, default=[],
                   help="also time KIVI's kernel at these pages an iteration (x each of --warps, if any)")
    p.add_argument("--tq-blocks", nargs="*", type=int, default=[],
                   help="also time TurboQuant's kernel at these positions an iteration (x each of --warps, if any)")
    p.add_argument("--fp8-stages", nargs="*", type=int, default=[],
                   help="also time FP8's kernel at these pipeline stages (its default tile and warps)")
    p.add_argument("--palu-tiles", nargs="*", default=[],
                   help="also time Palu's kernel at these "
                        "BLOCKxWARPSxSTAGES[xMAXNREG[xCHUNK[xROWS[xANGLES[xKEYROWS[xSPLITS]]]]]] (0: the default; "
                        "CHUNK: rotary frequencies a step, ROWS: query rows, ANGLES 1: keys turned by their "
                        "offset from the tile's smallest position, 2: from its first row index, 3: by their row "
                        "index (exact here, not for compacted rows), 4: by row index where the tile's positions "
                        "are its indices, else gathered, 5: by tile offset where the split's positions are its "
                        "indices, else gathered (keys-as-rows only); KEYROWS 1: the keys-as-rows kernel; SPLITS: "
                        "split-KV programs a row)")
    p.add_argument("--kivi-tiles", nargs="*", default=[],
                   help="also time KIVI's kernel at these PAGESxWARPSxSTAGES[xMAXNREG[xKEYROWS[xPAIRED]]] (0: the "
                        "default; KEYROWS 1: the keys-as-rows kernel, 0x0x0x0x1 at the default tile; PAIRED 1: a "
                        "token's value scales and zeros in one load)")
    p.add_argument("--splits", nargs="*", type=int, default=[],
                   help="also time each method's served kernel at these split-KV counts (by default "
                        "kernels/splits.py's decode_splits from the shapes: 64 at 6 x 130K)")
    p.add_argument("--palu-fp32", action="store_true", help="also time Palu's kernel with fp32 dots and table")
    p.add_argument("--palu-tiles-only", action="store_true",
                   help="Palu's --palu-tiles rows only (its first launch then is the first tile's: for ncu -c 1)")
    p.add_argument("--evict-mb", type=int, default=0,
                   help="before each timed call, copy this many MB (a served step's MLP between two layers' "
                        "attention: ~440 at Llama-3-8B's), its own time taken off: what the kernel reads every call "
                        "(Palu's rotary table and bases) no longer stays in L2 across calls")
    args = p.parse_args()
    ev = args.evict_mb
    print("| pool | batch x context | us/layer | step ms (32 layers) | pool MB read | pool floor us | % of floor | "
          "bf16 MB | bf16 floor us | bf16 floor / ours | max error / max of the torch path |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        bs, n = (int(x) for x in shape.split("x"))
        for label in args.methods:
            if label == FLASHINFER:
                print(_flashinfer_row(bs, n, ev), flush=True)
                continue
            if not (args.palu_tiles_only and label.startswith("palu")):
                print(_row(label, bs, n, None, ev), flush=True)
                for sp in args.splits:
                    print(_row(label, bs, n, {"splits": sp}, ev), flush=True)
            if label.startswith("palu"):
                if args.palu_fp32:
                    print(_row(label, bs, n, {"native": False}, ev), flush=True)
                for tile in args.palu_tiles:
                    print(_row(label, bs, n, {"tile": palu_tile(tile)}, ev), flush=True)
                continue
            tiles = {"fp8_kv": args.fp8_blocks, "turboquant": args.tq_blocks}.get(label, args.kivi_pages)
            size = "pages" if label.startswith("kivi") else "block"
            for b in tiles or [None]:
                for w in args.warps or [None]:
                    if b is not None or w is not None:
                        print(_row(label, bs, n, {size: b, "warps": w}, ev), flush=True)
            for tile in args.kivi_tiles if label.startswith("kivi") else []:
                pages, warps, stages, *more = (int(x) for x in tile.split("x"))
                maxnreg, key_rows, paired = (more + [0, 0, 0])[:3]
                knobs = {"pages": pages, "warps": warps, "stages": stages, "maxnreg": maxnreg}
                # the loop always explicit: left out, 4 bits on the GPU would take the served one (SERVED_LOOP)
                print(_row(label, bs, n, {**{k: v for k, v in knobs.items() if v}, "key_rows": bool(key_rows),
                                          "paired_scales": bool(paired)}, ev), flush=True)
            for st in args.fp8_stages if label == "fp8_kv" else []:
                print(_row(label, bs, n, {"stages": st}, ev), flush=True)


if __name__ == "__main__":
    main()
