"""Time a GPU operation as a decode step runs it: captured once in a CUDA graph, then replayed."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], iters: int = 100, warmup: int = 5) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph (``warmup`` eager calls first, so Triton has
    compiled and the caching allocator holds the buffers, then one untimed replay)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def graph_us_after_eviction(fn: Callable[[], object], evict_mb: int, iters: int = 100, warmup: int = 5) -> float:
    """:func:`graph_us` of ``fn`` as a served decode step meets it: each replay first copies ``evict_mb`` MB
    (what a layer's MLP streams through L2 between two attention calls), and that copy's own time is taken off.
    Without it, whatever ``fn`` reads again every replay (a rotary table, a basis) stays in L2 across replays."""
    if evict_mb <= 0:
        return graph_us(fn, iters, warmup)
    src = torch.empty(evict_mb << 19, dtype=torch.float16, device="cuda")  # evict_mb MiB read, as many written
    dst = torch.empty_like(src)

    def both() -> None:
        dst.copy_(src)
        fn()

    return graph_us(both, iters, warmup) - graph_us(lambda: dst.copy_(src), iters, warmup)
