"""Selection cost per layer on the GPU, stage by stage (no server), each stage replayed as a CUDA graph (as
in a decode step), beside the bandwidth floors. Quest (every selecting layer): page scoring (the served CUDA-core
kernel, and the tensor-core form ``score_pages(..., mma=True)`` beside it), top-k + sort
(torch) or the Triton radix select, slot-list expansion, the decode step's summary update (the general path
and the in-place decode kernel); against the summaries' and the dense KV's read. OmniKV (each filter layer):
token scoring (reads the layer's K; also its tensor-core form), top-k + sort or the Triton select. RetroInfer
(every layer, default config, every segment indexed with 16-member clusters): centroid logits, the group's
probabilities (torch / Triton), the ranking (sorted top-k / Triton tiers), the budgets, the decode kernel at
several split counts; the old per-layer path's sum beside the served one's, against the bytes it must read.

    python benchmarks/selection_overhead.py [--shapes 1x130000 5x130000 6x130000 16x32768] [--token-budget 2048]
        [--tables quest omnikv retroinfer] [--retro-splits 16 32 64]

Llama-3-8B heads (8 KV heads, group 4, dim 128), bf16 summaries, 16-token pages, rows 131,076 wide as SGLang's
(context length + 4; the scoring grid covers a row's full width, as inside a graph captured for the context
length; before 2026-12-03's last run the rows were 131,072 wide, a power of two the server never has).
"""

from __future__ import annotations

import argparse

import torch
from graph_timing import graph_us

from sgl_sparse.kernels import omnikv, pages, quest
from sgl_sparse.kernels import retroinfer as ri
from sgl_sparse.methods.selection.retroinfer import RetroInferConfig

PS, HKV, GROUP, D = 16, 8, 4, 128
WIDTH = 131072 + 4  # SGLang's req_to_token rows: the context length (Llama-3-8B's) + 4
HBM = 4.3e12  # bytes/s, the nominal copy rate BENCHMARKS.md's floors use
DEVICE = "cuda"  # RetroInfer's table: "cpu" under TRITON_INTERPRET=1 for a smoke run (tests/test_selection_overhead.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x130000", "5x130000", "6x130000", "16x32768"],
                   help="BATCHxCONTEXT")
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--tables", nargs="+", default=["quest", "omnikv", "retroinfer"],
                   choices=["quest", "omnikv", "retroinfer"])
    p.add_argument("--retro-splits", nargs="+", type=int, default=[16, 32, 64],
                   help="RetroInfer decode kernel split counts to time (the served one: ri.DECODE_SPLITS)")
    args = p.parse_args()
    if "quest" in args.tables:
        _quest_table(args)
    if "omnikv" in args.tables:
        _omnikv_table(args)
    if "retroinfer" in args.tables:
        _retroinfer_table(args)


def _quest_table(args: argparse.Namespace) -> None:
    k = args.token_budget // PS
    print("| batch x context | score us | score on the tensor cores us (same selection; max score difference) | "
          "top-k + sort us | Triton select us | expand us | summary update us (general / decode kernel) | "
          "total us/layer (Triton select, decode update) | summaries read at floor us | dense KV read at floor us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        bs, n = (int(x) for x in shape.split("x"))
        print(_row(bs, n, k))


def _omnikv_table(args: argparse.Namespace) -> None:
    print("\nOmniKV, per filter layer:\n")
    print("| batch x context | token scores us | on the tensor cores us (same selection) | top-k + sort us | "
          "Triton select us | K read at floor us |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        bs, n = (int(x) for x in shape.split("x"))
        print(_omnikv_row(bs, n, args.token_budget))


def _omnikv_row(bs: int, n: int, budget: int) -> str:
    dev = "cuda"
    r2t = torch.cat([torch.zeros(1, WIDTH, dtype=torch.int32, device=dev),
                     torch.arange(bs * WIDTH, device=dev, dtype=torch.int32).view(bs, WIDTH) + 1])
    rpi = torch.arange(1, bs + 1, device=dev)
    seq = torch.full((bs,), n, device=dev)
    k_cache = torch.randn(bs * WIDTH + 1, HKV, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(bs, HKV * GROUP, D, device=dev, dtype=torch.bfloat16)
    scores = torch.full((bs, WIDTH), float("-inf"), device=dev)
    omnikv.score_tokens(q, k_cache, r2t, rpi, seq, scores, 64, 512, mma=False)
    t_score = graph_us(lambda: omnikv.score_tokens(q, k_cache, r2t, rpi, seq, scores, 64, 512, mma=False))
    scores_mma = torch.full_like(scores, float("-inf"))
    omnikv.score_tokens(q, k_cache, r2t, rpi, seq, scores_mma, 64, 512, mma=True)
    t_mma = graph_us(lambda: omnikv.score_tokens(q, k_cache, r2t, rpi, seq, scores_mma, 64, 512, mma=True))
    sel = pages.select_pages(scores, budget)
    same_mma = torch.equal(sel, pages.select_pages(scores_mma, budget))
    t_topk = graph_us(lambda: pages.select_pages(scores, budget))
    t_tri = graph_us(lambda: pages.select_pages_triton(scores, budget, seq))
    same = torch.equal(sel, pages.select_pages_triton(scores, budget, seq))
    return (f"| {bs} x {n} | {t_score:.1f} | {t_mma:.1f} (same: {same_mma}) | {t_topk:.1f} | "
            f"{t_tri:.1f} (same lists: {same}) | {bs * n * HKV * D * 2 / HBM * 1e6:.1f} |")


def _row(bs: int, n: int, k: int) -> str:
    dev = "cuda"
    row_pages = -(-WIDTH // PS)
    npg = bs * row_pages + 8
    # Each request's positions in its own whole pages (page 0 is SGLang's padding page).
    r2t = torch.zeros(bs + 1, WIDTH, dtype=torch.int32, device=dev)
    r2t[1:] = (torch.arange(bs, device=dev)[:, None] * row_pages * PS + torch.arange(WIDTH, device=dev) + PS).int()
    rpi = torch.arange(1, bs + 1, device=dev)
    seq = torch.full((bs,), n, device=dev)
    kmin = torch.randn(npg, HKV, D, device=dev, dtype=torch.bfloat16)
    kmax = kmin + 1
    q = torch.randn(bs, HKV * GROUP, D, device=dev, dtype=torch.bfloat16)
    scores = torch.empty(bs * HKV, -(-WIDTH // PS), device=dev)  # as QuestSelector.select: 8,193 columns
    lens = pages.selected_lens(seq, PS, k).repeat_interleave(HKV).int()
    indptr = torch.zeros(bs * HKV + 1, dtype=torch.int32, device=dev)
    indptr[1:] = lens.cumsum(0)
    out = torch.empty(int(indptr[-1]), dtype=torch.int32, device=dev)
    quest.score_pages(q, kmin, kmax, r2t, rpi, seq, scores, PS, 4, 32, mma=False)
    sel = pages.select_pages(scores, k)
    t_score = graph_us(lambda: quest.score_pages(q, kmin, kmax, r2t, rpi, seq, scores, PS, 4, 32, mma=False))
    # The tensor-core form (quest._score_kernel_mma) on the same inputs: its time, whether it selects the same pages,
    # and its largest difference from the CUDA-core scores (finite entries; sink and recent pages are +inf in both).
    scores_mma = torch.empty_like(scores)
    quest.score_pages(q, kmin, kmax, r2t, rpi, seq, scores_mma, PS, 4, 32, mma=True)
    t_mma = graph_us(lambda: quest.score_pages(q, kmin, kmax, r2t, rpi, seq, scores_mma, PS, 4, 32, mma=True))
    fin = torch.isfinite(scores)
    same_mma = torch.equal(sel, pages.select_pages(scores_mma, k)) and torch.equal(fin, torch.isfinite(scores_mma))
    diff = float((scores_mma[fin] - scores[fin]).abs().max()) if fin.any() else 0.0
    t_topk = graph_us(lambda: pages.select_pages(scores, k))
    # As the server calls it: the sequence lengths, one per KV head's row, in pages.
    same = torch.equal(sel, pages.select_pages_triton(scores, k, seq, HKV, PS))
    t_tri = graph_us(lambda: pages.select_pages_triton(scores, k, seq, HKV, PS))
    t_expand = graph_us(lambda: pages.expand_pages(sel, r2t, rpi, seq, indptr, out, PS))
    # A decode step's K write: each request's next position (its open page), as one token per request.
    loc = r2t[rpi, n].long()
    knew = torch.randn(bs, HKV, D, device=dev, dtype=torch.bfloat16)
    t_sum = graph_us(lambda: quest.update_page_summaries(kmin, kmax, loc, knew, PS))
    t_sum_dec = graph_us(lambda: quest.update_decode_summaries(kmin, kmax, loc, knew, PS))
    summaries = bs * -(-n // PS) * HKV * D * 2 * 2
    dense = bs * n * HKV * D * 2 * 2
    return (f"| {bs} x {n} | {t_score:.1f} | {t_mma:.1f} (same: {same_mma}; {diff:.1e}) | {t_topk:.1f} | "
            f"{t_tri:.1f} (same lists: {same}) | {t_expand:.1f} | "
            f"{t_sum:.1f} / {t_sum_dec:.1f} | {t_score + t_tri + t_expand + t_sum_dec:.1f} | "
            f"{summaries / HBM * 1e6:.1f} | {dense / HBM * 1e6:.1f} |")


def _retroinfer_table(args: argparse.Namespace) -> None:
    splits = " | ".join(f"decode, {n} splits us" for n in args.retro_splits)
    print("\nRetroInfer, per layer (default config):\n")
    print(f"| batch x context | logits us | group probs, torch / Triton us | sorted top-k / Triton tiers us (same "
          f"sets) | budgets us | {splits} | old path us/layer | served path us/layer | read at floor us |")
    print("| --- | --- | --- | --- | --- | " + "--- | " * len(args.retro_splits) + "--- | --- | --- |")
    for shape in args.shapes:
        bs, n = (int(x) for x in shape.split("x"))
        print(_retroinfer_row(bs, n, args.retro_splits))


def _retroinfer_row(bs: int, n: int, split_counts: list[int]) -> str:
    """A synthetic index with the served layout: each request in its own whole pages, every segment usable,
    cluster j of a segment = its j-th page's 16 tokens (sizes 16, members in order); random centroids and
    values (the kernels' cost does not depend on what the clusters hold, the ranking's little)."""
    dev = DEVICE
    lay = RetroInferConfig().layout()
    row_pages = -(-WIDTH // PS)
    r2t = torch.zeros(bs + 1, WIDTH, dtype=torch.int32, device=dev)
    r2t[1:] = (torch.arange(bs, device=dev)[:, None] * row_pages * PS + torch.arange(WIDTH, device=dev) + PS).int()
    rpi = torch.arange(1, bs + 1, device=dev)
    seq = torch.full((bs,), n, device=dev)
    slots = (bs * row_pages + 1) * PS
    k_cache = torch.randn(slots, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    store = ri.IndexStore.empty(slots, PS, HKV, D, torch.bfloat16, dev)
    store.centroids.normal_()
    store.value_sums.normal_().mul_(PS)
    store.sizes.fill_(PS)
    page_in_row = (torch.arange(slots // PS, device=dev) - 1) % row_pages  # page 0: padding
    store.offsets.copy_((((page_in_row - lay.base // PS) % lay.clusters_per_segment) * PS)[:, None].int())
    pos = (torch.arange(slots, device=dev) - PS) % (row_pages * PS)
    store.order.copy_(((pos - lay.base) % lay.seg)[:, None].to(torch.int16))
    max_seg = (WIDTH - lay.base) // lay.seg
    seg_valid = torch.ones(bs, max_seg, dtype=torch.int8, device=dev)
    q = torch.randn(bs, HKV * GROUP, D, device=dev, dtype=torch.bfloat16)
    scale = D**-0.5
    width = lay.max_ranked(WIDTH)
    args = (q, store, r2t, rpi, seq, seg_valid, lay, scale, max_seg)
    t_logits = graph_us(lambda: ri.cluster_logits(*args))
    logits = ri.cluster_logits(*args)
    t_probs_torch = graph_us(lambda: ri._group_probs(logits))
    t_probs = graph_us(lambda: ri.group_probs(logits))
    scores = ri.group_probs(logits)
    r, e = ri.row_budgets(seq, seg_valid, lay, max_seg)
    t_budgets = graph_us(lambda: ri.row_budgets(seq, seg_valid, lay, max_seg))
    ranked = ri.rank_clusters(scores, width)
    tiers = ri.rank_clusters_triton(scores, width, r, e, HKV)
    same = all(sorted(x for x in a[lo:hi] if x >= 0) == sorted(x for x in b[lo:hi] if x >= 0)
               for a, b, nr, ne in zip(ranked.tolist(), tiers.tolist(), r.repeat_interleave(HKV).tolist(),
                                       e.repeat_interleave(HKV).tolist())
               for lo, hi in ((0, nr), (nr, nr + ne)))
    t_topk = graph_us(lambda: ri.rank_clusters(scores, width))
    t_tiers = graph_us(lambda: ri.rank_clusters_triton(scores, width, r, e, HKV))
    t_dec = {s: graph_us(lambda s=s: ri.decode_attention(q, k_cache, v_cache, store, r2t, rpi, seq, seg_valid, tiers,
                                                          r, e, lay, scale, splits=s)) for s in split_counts}
    served = t_dec.get(ri.DECODE_SPLITS, min(t_dec.values()))
    old = t_logits + t_probs_torch + t_topk + t_budgets + served
    new = t_logits + t_probs + t_tiers + served
    cfg = {"num_hidden_layers": 1, "hidden_size": HKV * GROUP * D, "num_attention_heads": HKV * GROUP,
           "num_key_value_heads": HKV}
    from decode_throughput import selection_kv_bytes

    read = selection_kv_bytes("retroinfer", {}, cfg, bs, bs * n)
    decs = " | ".join(f"{t_dec[s]:.1f}" for s in split_counts)
    return (f"| {bs} x {n} | {t_logits:.1f} | {t_probs_torch:.1f} / {t_probs:.1f} | {t_topk:.1f} / {t_tiers:.1f} "
            f"({same}) | {t_budgets:.1f} | {decs} | {old:.1f} | {new:.1f} | {read / HBM * 1e6:.1f} |")


if __name__ == "__main__":
    main()
