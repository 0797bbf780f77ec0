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
