"""PyramidKV on the GPU: its per-layer sets' decode kernel (kernels/layer_sets.py) at serving shapes against its
torch reference, without a host sync, and inside a CUDA graph whose sets change between replays (as ``bind``
changes them between decode steps); then servers (quality-large, bf16, FlashInfer base for prefill): a covering
budget serves vanilla FlashInfer's tokens (every layer reads every position through our kernel: near-ties
tolerated), a small budget keeps a different set per layer, evicts what no layer keeps, gives the same tokens with
decode CUDA graphs on and off, continues a conversation from its Chain Cache, and ends idle and sound.

Passed 4 of 4 on an H100 (2026-12-07), so PyramidKV serves on CUDA by default (``GPU_VERIFIED_LAYER_SETS`` in
``integration/launch.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gpu_common import (
    SELECTION_LENS,
    assert_idle_and_sound,
    assert_same_tokens,
    decode_lines,
    generate,
    log_mark,
    log_since,
    prose,
    selection_servers,
    state,
    token_agreement,
)

from sgl_sparse.integration.syncs import sync_debug
from sgl_sparse.kernels import layer_sets
from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu
DEV = "cuda"
HKV, G, D = 8, 4, 128  # Llama-3-8B's attention


def _sets(gen: torch.Generator, lens: list[int], width: int, rows: int) -> tuple[torch.Tensor, ...]:
    """Per row ``1..len(lens)``: a sorted set of up to ``width`` positions before a tail 64 before its length."""
    keep = torch.zeros(rows, width, dtype=torch.int32)
    count = torch.zeros(rows, dtype=torch.int32)
    tail = torch.zeros(rows, dtype=torch.int32)
    for row, n in enumerate(lens, start=1):
        t = max(n - 64, 0)
        m = min(t, int(torch.randint(1, width + 1, (1,), generator=gen)))
        p = torch.randperm(t, generator=gen)[:m].sort().values
        keep[row, :m], count[row], tail[row] = p.int(), m, t
    return keep.to(DEV), count.to(DEV), tail.to(DEV)


def test_decode_kernel_at_a_serving_shape_matches_torch_in_and_out_of_a_cuda_graph() -> None:
    """8 requests of up to 130K tokens in rows 131,072 wide, sets of up to 16K positions, sentinels in the rows, plus
    2 CUDA-graph padding rows (length 1)."""
    gen = torch.Generator().manual_seed(0)
    lens = [130_000, 9000, 4097, 16, 1, 65_000, 8191, 3000, 1, 1]
    width, n_slots = 16_384, 240_000
    k = torch.randn(n_slots, HKV, D, generator=gen).to(DEV, torch.bfloat16)
    v = torch.randn(n_slots, HKV, D, generator=gen).to(DEV, torch.bfloat16)
    r2t = torch.zeros(9, 131_072, dtype=torch.int32)
    for row, n in enumerate(lens[:8], start=1):
        r2t[row, :n] = torch.randint(1, n_slots, (n,), generator=gen, dtype=torch.int32)
        r2t[row, : n // 2][torch.rand(n // 2, generator=gen) < 0.5] = 0  # evicted by an earlier selection
    r2t = r2t.to(DEV)
    rpi = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 0, 0], device=DEV)
    seq = torch.tensor(lens, device=DEV)
    q = torch.randn(len(lens), HKV * G, D, generator=gen).to(DEV, torch.bfloat16)
    keep, count, tail = _sets(gen, lens[:8], width, 9)
    scale = D**-0.5
    with sync_debug("error"):
        got = layer_sets.decode_attention(q, k, v, r2t, rpi, seq, keep, count, tail, scale)
    want = layer_sets.decode_attention_torch(q, k, v, r2t, rpi, seq, keep, count, tail, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)

    # Captured once; the sets change in place between replays, as bind writes them before a decode step.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer_sets.decode_attention(q, k, v, r2t, rpi, seq, keep, count, tail, scale)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer_sets.decode_attention(q, k, v, r2t, rpi, seq, keep, count, tail, scale)
    for seed in (1, 2):
        k2, c2, t2 = _sets(torch.Generator().manual_seed(seed), lens[:8], width, 9)
        keep.copy_(k2)
        count.copy_(c2)
        tail.copy_(t2)
        graph.replay()
        want = layer_sets.decode_attention_torch(q, k, v, r2t, rpi, seq, keep, count, tail, scale)
        torch.testing.assert_close(out[:8].float(), want[:8].float(), atol=2e-2, rtol=2e-2)


SMALL = {"budget": 1024, "decode_interval": 64}
COVERING = {"budget": 16384}
OUT = 160


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = selection_servers("pyramidkv", COVERING, SMALL)
    with running(*procs.values()):
        yield procs


def test_a_covering_budget_serves_vanillas_tokens(servers: dict[str, ServerProcess]) -> None:
    prompts = [prose(1900 + i, n) for i, n in enumerate(SELECTION_LENS)]
    srv = servers["covering"]
    before = state(srv)["evicted_tokens_total"]
    ref, got = generate(servers["vanilla"], prompts, 64), generate(srv, prompts, 64)
    # Every layer reads every position through our kernel, FlashInfer's in vanilla: bf16 kernels of different
    # shapes, so a near-tie may flip; anything else is a different read.
    assert_same_tokens(ref, got, "vanilla", "pyramidkv covering", "batch of 5", tie_gap=0.05)
    assert token_agreement(ref, got) >= 0.9
    assert state(srv)["evicted_tokens_total"] == before
    assert_idle_and_sound(srv)


def test_a_small_budget_reads_its_layer_sets_in_decode_graphs_as_eagerly(servers: dict[str, ServerProcess]) -> None:
    prompts = [prose(2000 + i, n) for i, n in enumerate(SELECTION_LENS)]
    srv, eager = servers["small"], servers["small-eager"]
    before = state(srv)["evicted_tokens_total"]
    mark = log_mark(srv)
    outs = generate(srv, prompts, OUT)
    st = state(srv)
    assert st["evicted_tokens_total"] > before
    stats = st["method_stats"]
    # The union a slot holds is larger than what a layer reads: the layers kept different sets.
    assert stats["selections"] >= len(prompts) and stats["union_over_mean_layer"] > 1.0, stats
    assert all(len(o.ids) == OUT for o in outs)
    assert any(graph for _, graph in decode_lines(log_since(srv, mark))), "no decode step replayed a CUDA graph"
    assert_idle_and_sound(srv)
    assert_same_tokens(generate(eager, prompts, OUT), outs, "pyramidkv eager", "pyramidkv graph", "batch of 5")
    assert_idle_and_sound(eager)


def test_a_conversation_continues_from_its_chain_cache(servers: dict[str, ServerProcess]) -> None:
    srv = servers["small"]
    first = prose(2100, 5000)
    out = generate(srv, [first], 48)[0]
    hits = state(srv)["chain_hits_total"]
    follow = first + out.ids + prose(2101, 300)
    again = generate(srv, [follow], 48)[0]
    assert len(again.ids) == 48
    assert state(srv)["chain_hits_total"] > hits  # resumed from the compacted KV the first turn kept
    assert again.meta["cached_tokens"] >= len(first)
    assert_idle_and_sound(srv)
