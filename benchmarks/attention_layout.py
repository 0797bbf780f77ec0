"""How the physical layout of retained KV slots changes FlashInfer's decode speed (one layer).

After SnapKV keeps 8,192 of a 130K prompt, a request's live slots are spread over the 130K slots its
prompt was allocated; vanilla SGLang's slots for the same number of tokens are (nearly) contiguous.
This times the decode kernel SGLang runs for Llama-3-8B (FlashInfer's paged decode, tensor cores,
NHD, page size 1, bf16) on the same number of tokens under three layouts, so the cost of scattering
(and what relocating the kept KV into contiguous slots would gain) is measured, not guessed:

* ``contiguous``: each request's slots are one run (what vanilla has, and what relocation gives);
* ``snapkv``: sinks + the top of avg-pooled random scores over a 130K region + the window + a
  contiguous decode tail, the kept pattern of ``snapkv {"budget": 8192}`` on a random-weight model;
* ``random``: the same count drawn uniformly from the region (the worst case).

    python benchmarks/attention_layout.py --batch 52 --kept 8448 --region 130000

Prints per layout: microseconds per layer call, GB/s of K+V read, % of the copy rate measured on the
same GPU (a device-to-device copy of the same bytes), and the whole-step estimate for 32 layers.
"""

from __future__ import annotations

import argparse

import torch


def snapkv_like(
    region: int,
    budget: int,
    tail: int,
    sink: int = 64,
    window: int = 32,
    kernel: int = 5,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """Kept positions of one request: sinks, window, the top of avg-pooled random scores, a tail."""
    scores = torch.rand(region, generator=gen)
    pooled = torch.nn.functional.avg_pool1d(scores[None, None], kernel, 1, kernel // 2, count_include_pad=False)[0, 0]
    pooled[:sink] = float("inf")
    pooled[region - window :] = float("inf")
    keep = pooled.topk(budget).indices.sort().values
    return torch.cat([keep, torch.arange(region, region + tail)])


def layouts(batch: int, kept: int, region: int, budget: int, seed: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {"contiguous": [], "snapkv": [], "random": []}
    span = region + kept  # each request's own slot range, as a 130K prompt plus its decode tail occupies
    for i in range(batch):
        base = 1 + i * span  # slot 0 is SGLang's padding slot
        out["contiguous"].append(base + torch.arange(kept))
        out["snapkv"].append(base + snapkv_like(region, budget, kept - budget, gen=gen))
        out["random"].append(base + torch.randperm(region, generator=gen)[:kept].sort().values)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=52)
    ap.add_argument("--kept", type=int, default=8448, help="live tokens per request")
    ap.add_argument("--budget", type=int, default=8192, help="SnapKV budget (kept - budget: decode tail)")
    ap.add_argument("--region", type=int, default=130000, help="prompt length the kept set is spread over")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32, help="for the whole-step estimate")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import flashinfer

    dev = torch.device("cuda")
    slots = 1 + a.batch * (a.region + a.kept)
    k = torch.randn(slots, 1, a.kv_heads, a.head_dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(a.batch, a.heads, a.head_dim, dtype=torch.bfloat16, device=dev)
    workspace = torch.empty(384 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    bytes_read = 2 * a.batch * a.kept * a.kv_heads * a.head_dim * 2

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(a.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / a.iters  # microseconds

    src = torch.empty(bytes_read // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_us = timed(lambda: dst.copy_(src)) / 2  # a copy reads and writes: half its time reads
    copy_gbs = bytes_read / copy_us / 1e3

    print(
        f"batch {a.batch} x {a.kept} live tokens (K+V {bytes_read / 1e9:.2f} GB per layer), region {a.region}; "
        f"copy rate {copy_gbs:.0f} GB/s (read side of a device copy)"
    )
    print(
        "| layout | mean run length (slots) | us per layer | GB/s | % of copy rate | step estimate ms "
        f"({a.layers} layers) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    base_us = None
    for name, rows in layouts(a.batch, a.kept, a.region, a.budget, a.seed).items():
        indices = torch.cat(rows).to(torch.int32).to(dev)
        indptr = torch.zeros(a.batch + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor([r.numel() for r in rows]), 0)
        runs = sum(int((r.diff() != 1).sum()) + 1 for r in rows)
        wrapper.plan(
            indptr.to(dev),
            indices,
            torch.ones(a.batch, dtype=torch.int32, device=dev),
            a.heads,
            a.kv_heads,
            a.head_dim,
            1,
            data_type=torch.bfloat16,
            q_data_type=torch.bfloat16,
        )
        us = timed(lambda: wrapper.run(q, (k, v)))
        base_us = base_us or us
        gbs = bytes_read / us / 1e3
        print(
            f"| {name} | {a.batch * a.kept / runs:.1f} | {us:.1f} ({us / base_us:.3f}x) | {gbs:.0f} | "
            f"{100 * gbs / copy_gbs:.0f}% | {us * a.layers / 1e3:.2f} |"
        )
    compaction_cost(a, dev, timed)


def compaction_cost(a: argparse.Namespace, dev: torch.device, timed) -> None:  # type: ignore[no-untyped-def]
    """Once per decode step (not per layer) our list build scans every row: its time beside the step."""
    from sgl_sparse.kernels.compact import fill_compact_kv_indices
    from sgl_sparse.slots import SENTINEL_SLOT

    width = 131072 + 8  # req_to_token columns of a 131,072-token context
    gen = torch.Generator().manual_seed(a.seed)
    req_to_token = torch.full((a.batch + 1, width), SENTINEL_SLOT, dtype=torch.int32)
    for i in range(a.batch):
        pos = snapkv_like(a.region, a.budget, a.kept - a.budget, gen=gen)
        req_to_token[i + 1, pos] = 1 + i * width + pos.to(torch.int32)
    req_to_token = req_to_token.to(dev)
    rows = torch.arange(1, a.batch + 1, device=dev)
    seq_lens = torch.full((a.batch,), a.region + a.kept - a.budget, dtype=torch.int32, device=dev)
    counts = torch.full((a.batch,), a.kept, dtype=torch.int32, device=dev)
    indptr = torch.zeros(a.batch + 1, dtype=torch.int32, device=dev)
    indices = torch.empty(a.batch * width, dtype=torch.int32, device=dev)
    mism = torch.zeros(1, dtype=torch.int64, device=dev)

    def build() -> None:
        fill_compact_kv_indices(req_to_token, rows, seq_lens, indptr, indices, min_one=True, counts=counts,
                                mismatches=mism)

    eager_us = timed(build)  # host launches included: what a step pays when the host is the bottleneck
    stream = torch.cuda.Stream()  # GPU time alone: the same build captured in a CUDA graph and replayed
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        build()
    gpu_us = timed(graph.replay)
    host_us = _host_time(build)
    print(f"\ncompacted list build (once per step), {a.batch} rows of {width}: GPU {gpu_us:.1f} us, host launches "
          f"{host_us:.1f} us, eager loop {eager_us:.1f} us per call; mismatches {int(mism)} (expect 0)")


def _host_time(fn, iters: int = 200) -> float:  # type: ignore[no-untyped-def]
    """Microseconds the host spends launching ``fn`` (GPU not waited for inside the loop)."""
    import time

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t) * 1e6 / iters
    torch.cuda.synchronize()
    return host

if __name__ == "__main__":
    main()
