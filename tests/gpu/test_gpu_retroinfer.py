"""RetroInfer on the GPU: its Triton scorer and decode kernel at a serving shape against the torch
paths (no host sync), and servers (FlashInfer base for prefill and dense layers, RetroInfer's own decode attention)
against vanilla FlashInfer and against themselves without CUDA graphs. Own module, so that its servers
and the other methods' do not all hold the GPU at once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gpu_common import check_covering_equals_vanilla, check_graphs_equal_eager, selection_servers

from sgl_sparse.integration.syncs import sync_debug
from sgl_sparse.kernels import retroinfer as ri
from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu
DEV = "cuda"


def test_decode_kernel_at_a_serving_shape_matches_torch_and_does_not_sync() -> None:
    """Llama-8B heads (8 KV heads, group 4, dim 128, bf16), 16-token pages, 1,024-token segments, rows
    131,072 wide; requests of 40K, 20K (one segment not usable) and 3K tokens (dense: under 16 segments)
    plus a CUDA-graph padding row."""
    g = torch.Generator().manual_seed(0)
    lay = ri.Layout(base=16, seg=1024, page=16, recent=64, min_segments=16, retrieval=0.018, estimation=0.232)
    hkv, grp, d, width = 8, 4, 128, 131072
    lens = [40000, 20000, 3000, 1]
    num_pages = sum(-(-n // 16) for n in lens) + 8
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    r2t = torch.zeros(len(lens) + 1, width, dtype=torch.int32)
    for row, n in enumerate(lens[:3], start=1):
        pos = torch.arange(n)
        pg = torch.tensor([free.pop() for _ in range(-(-n // 16))])
        r2t[row, :n] = (pg[pos // 16] * 16 + pos % 16).to(torch.int32)
    r2t = r2t.to(DEV)
    rpi = torch.tensor([1, 2, 3, 0], device=DEV)
    seq = torch.tensor(lens, device=DEV)
    k = torch.randn(num_pages * 16, hkv, d, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn_like(k)
    store = ri.IndexStore.empty(k.shape[0], 16, hkv, d, torch.bfloat16, DEV)
    nseg = lay.num_segments(seq).tolist()
    rows = [r for r, n in zip([1, 2, 3, 0], nseg) for _ in range(n)]
    segs = [s for n in nseg for s in range(n)]
    ri.build_segments(store, k, v, r2t, torch.tensor(rows, device=DEV), torch.tensor(segs, device=DEV), lay)
    max_seg = (width - lay.base) // lay.seg
    seg_valid = torch.zeros(len(lens), max_seg, dtype=torch.int8, device=DEV)
    for i, n in enumerate(nseg):
        seg_valid[i, :n] = 1
    seg_valid[1, 3] = 0
    q = torch.randn(len(lens), hkv * grp, d, generator=g).to(DEV, torch.bfloat16)
    scale = d**-0.5
    scores = ri.cluster_scores_torch(q, store, r2t, rpi, seq, seg_valid, lay, scale, max_seg)
    with sync_debug("error"):
        fast = ri.cluster_scores(q, store, r2t, rpi, seq, seg_valid, lay, scale, max_seg)
    finite = scores.isfinite()
    assert torch.equal(finite, fast.isfinite())
    torch.testing.assert_close(fast[finite], scores[finite], atol=1e-4, rtol=1e-3)
    ranked = ri.rank_clusters(scores, lay.max_ranked(width))
    r, e = ri.row_budgets(seq, seg_valid, lay, max_seg)
    assert r.tolist()[:3] == [max(round(0.018 * c), 1) for c in (38 * 64, 18 * 64)] + [0]
    with sync_debug("error"):
        tiers = ri.rank_clusters_triton(scores, lay.max_ranked(width), r, e, hkv)
    # The served ranking: the sorted top-k's two tiers as sets, each in position order.
    for row, (got_row, want_row) in enumerate(zip(tiers.tolist(), ranked.tolist())):
        nr, ne = int(r[row // hkv]), int(e[row // hkv])
        for lo, hi in ((0, nr), (nr, nr + ne)):
            want = sorted(x for x in want_row[lo:hi] if x >= 0)
            assert got_row[lo:hi] == want + [-1] * (hi - lo - len(want)), (row, lo, hi)
    with sync_debug("error"):
        got = ri.decode_attention(q, k, v, store, r2t, rpi, seq, seg_valid, tiers, r, e, lay, scale)
    ref = ri.decode_attention_torch(q.cpu(), k.cpu(), v.cpu(), _cpu(store), r2t.cpu(), rpi.cpu(), seq.cpu(),
                                    seg_valid.cpu(), ranked.cpu(), r.cpu(), e.cpu(), lay, scale)
    torch.testing.assert_close(got.float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)


def _cpu(store: ri.IndexStore) -> ri.IndexStore:
    return ri.IndexStore(*(t.cpu() for t in (store.centroids, store.value_sums, store.sizes, store.offsets,
                                             store.order)))


# 1,024-token segments from 1,024 clustered tokens on, so the 2-6K prompts of the server checks are
# indexed; the covering config reads every cluster exactly.
BASE = {"segment_tokens": 1024, "min_index_tokens": 1024, "recent_tokens": 64}
COVERING = {**BASE, "retrieval_ratio": 1.0, "estimation_ratio": 0.0}
SMALL = {**BASE, "retrieval_ratio": 0.1, "dense_layers": 1}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = selection_servers("retroinfer", COVERING, SMALL)
    with running(*procs.values()):
        yield procs


def test_retroinfer_covering_the_context_equals_vanilla(servers: dict[str, ServerProcess]) -> None:
    check_covering_equals_vanilla(servers, "retroinfer", 800)


def test_retroinfer_cuda_graphs_on_and_off_give_the_same_tokens(servers: dict[str, ServerProcess]) -> None:
    check_graphs_equal_eager(servers, "retroinfer", 900)
