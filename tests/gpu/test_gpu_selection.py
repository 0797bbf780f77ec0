"""The selection family on the GPU (Quest, OmniKV): Triton kernels at serving shapes against the torch
paths, and servers (FlashInfer base, head-flattened selection wrapper) against vanilla FlashInfer and
against themselves without CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gpu_common import check_covering_equals_vanilla, check_graphs_equal_eager, selection_servers

from sgl_sparse.integration.syncs import sync_debug
from sgl_sparse.kernels import omnikv, pages, quest
from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu
DEV = "cuda"


def test_quest_kernels_at_a_serving_shape_match_torch_and_do_not_sync() -> None:
    """Llama-8B heads (8 KV heads, group 4, dim 128), 16-token pages, rows 131,072 wide, 6 requests of
    up to 9K tokens plus 2 CUDA-graph padding rows."""
    g = torch.Generator().manual_seed(0)
    ps, hkv, grp, d, width = 16, 8, 4, 128, 131072
    lens = [9000, 4097, 16, 1, 8191, 3000, 1, 1]
    num_pages = sum((n + ps - 1) // ps for n in lens) + 8
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    r2t = torch.zeros(len(lens) + 1, width, dtype=torch.int32)
    for row, n in enumerate(lens[:6], start=1):
        pos = torch.arange(n)
        pg = torch.tensor([free.pop() for _ in range((n + ps - 1) // ps)])
        r2t[row, :n] = (pg[pos // ps] * ps + pos % ps).to(torch.int32)
    rpi = torch.tensor([1, 2, 3, 4, 5, 6, 0, 0], device=DEV)
    seq = torch.tensor(lens, device=DEV)
    r2t = r2t.to(DEV)
    k_buf = torch.randn(num_pages * ps, hkv, d, generator=g).to(DEV, torch.bfloat16)
    kmin = torch.full((num_pages, hkv, d), float("inf"), dtype=torch.bfloat16, device=DEV)
    kmax = torch.full_like(kmin, float("-inf"))
    loc = torch.cat([r2t[r, :n].long() for r, n in zip(range(1, 7), lens[:6])])
    q = torch.randn(len(lens), hkv * grp, d, generator=g).to(DEV, torch.bfloat16)
    max_pages = width // ps
    got = torch.empty(len(lens) * hkv, max_pages, device=DEV)
    with sync_debug("error"):
        quest.update_page_summaries(kmin, kmax, loc, k_buf[loc], ps)
        quest.score_pages(q, kmin, kmax, r2t, rpi, seq, got, ps, 4, 32, mma=False)
        sel = pages.select_pages(got, 128)
    ref = torch.empty_like(got)
    quest.score_pages_torch(q, kmin, kmax, r2t, rpi, seq, ref, ps, 4, 32)
    # A decode step's write (the next position of each request, two padding rows at slot 0) through the
    # in-place kernel equals the general path's, without a sync.
    nxt = torch.tensor([int(r2t[r, n - 1]) + 1 if n % ps else 0 for r, n in zip(range(1, 7), lens[:6])] + [0, 0],
                       device=DEV)
    knew = torch.randn(len(nxt), hkv, d, generator=g).to(DEV, torch.bfloat16)
    dmin, dmax = kmin.clone(), kmax.clone()
    with sync_debug("error"):
        quest.update_decode_summaries(dmin, dmax, nxt, knew, ps)
    rmin, rmax = kmin.clone(), kmax.clone()
    quest.update_page_summaries(rmin, rmax, nxt, knew, ps)
    assert torch.equal(dmin[1:], rmin[1:]) and torch.equal(dmax[1:], rmax[1:])
    finite = ref.isfinite()
    assert torch.equal(finite, got.isfinite()) and torch.equal(ref[~finite], got[~finite])
    assert torch.allclose(got[finite], ref[finite], rtol=1e-3, atol=1e-2)
    # The tensor-core form (q+ . max + q- . min): the same bounds, without a sync.
    mma = torch.empty_like(got)
    with sync_debug("error"):
        quest.score_pages(q, kmin, kmax, r2t, rpi, seq, mma, ps, 4, 32, mma=True)
    assert torch.equal(finite, mma.isfinite()) and torch.equal(ref[~finite], mma[~finite])
    assert torch.allclose(mma[finite], ref[finite], rtol=1e-3, atol=1e-2)
    lens_rows = pages.selected_lens(seq, ps, 128).repeat_interleave(hkv).to(torch.int32)
    indptr = torch.zeros(lens_rows.numel() + 1, dtype=torch.int32, device=DEV)
    indptr[1:] = torch.cumsum(lens_rows, 0)
    out = torch.full((int(indptr[-1]) + 16,), -1, dtype=torch.int32, device=DEV)
    with sync_debug("error"):
        pages.expand_pages(sel, r2t, rpi, seq, indptr, out, ps)
    mask = pages.selected_positions_mask(sel, seq, hkv, ps, 9000)
    want = []
    for b in range(len(lens)):
        row = r2t[rpi[b], :9000].long()
        for h in range(hkv):
            want.append(row[mask[b, h]] * hkv + h)
    assert torch.equal(out[: int(indptr[-1])].long(), torch.cat(want))
    assert (out[int(indptr[-1]):] == -1).all()


def test_triton_select_and_omnikv_scores_at_serving_shapes_match_torch_and_do_not_sync() -> None:
    """The threshold select against torch.topk + sort at Quest's shape (64 rows x 8,192 pages, 128) and
    OmniKV's (8 rows x 131,072 tokens, 2,048); OmniKV's token scores against the torch path."""
    g = torch.Generator().manual_seed(1)
    for rows, width, k in ((64, 8192, 128), (8, 131072, 2048)):
        counts = torch.randint(0, width + 1, (rows,), generator=g).to(DEV)
        counts[:2] = torch.tensor([width, 1])
        scores = torch.rand(rows, width, generator=g).to(DEV)
        pos = torch.arange(width, device=DEV)[None, :]
        scores[:, :4] = float("inf")
        scores = torch.where(pos < counts[:, None], scores, torch.full_like(scores, float("-inf")))
        with sync_debug("error"):
            got = pages.select_pages_triton(scores, k, counts)
        assert torch.equal(got, pages.select_pages(scores, k)), (rows, width)
    hkv, grp, d, width, lens = 8, 4, 128, 131072, [9000, 4097, 16, 1, 1]
    slots = torch.randperm(sum(lens) + 64, generator=g)[: sum(lens)] + 1
    r2t = torch.zeros(len(lens) + 1, width, dtype=torch.int32)
    start = 0
    for row, n in enumerate(lens[:4], start=1):
        r2t[row, :n] = slots[start:start + n].to(torch.int32)
        start += n
    r2t = r2t.to(DEV)
    rpi = torch.tensor([1, 2, 3, 4, 0], device=DEV)
    seq = torch.tensor(lens, device=DEV)
    k_cache = torch.randn(sum(lens) + 65, hkv, d, generator=g).to(DEV, torch.bfloat16)
    q = torch.randn(len(lens), hkv * grp, d, generator=g).to(DEV, torch.bfloat16)
    got = torch.full((len(lens), width), float("-inf"), device=DEV)
    with sync_debug("error"):
        omnikv.score_tokens(q, k_cache, r2t, rpi, seq, got, 64, 512, mma=False)
    ref = torch.empty_like(got)
    omnikv.score_tokens_torch(q, k_cache, r2t, rpi, seq, ref, 64, 512)
    finite = ref.isfinite()
    assert torch.equal(finite, got.isfinite()) and torch.equal(ref[~finite], got[~finite])
    assert torch.allclose(got[finite], ref[finite], rtol=1e-3, atol=1e-2)
    mma = torch.full((len(lens), width), float("-inf"), device=DEV)  # the tensor-core form
    with sync_debug("error"):
        omnikv.score_tokens(q, k_cache, r2t, rpi, seq, mma, 64, 512, mma=True)
    assert torch.equal(finite, mma.isfinite()) and torch.equal(ref[~finite], mma[~finite])
    assert torch.allclose(mma[finite], ref[finite], rtol=1e-3, atol=1e-2)


COVERING = {"token_budget": 16384, "sink_tokens": 64, "recent_tokens": 512, "dense_layers": 0}
SMALL = {"token_budget": 1024, "sink_tokens": 64, "recent_tokens": 256, "dense_layers": 2}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = selection_servers("quest", COVERING, SMALL)
    with running(*procs.values()):
        yield procs


def test_quest_covering_the_context_equals_vanilla(servers: dict[str, ServerProcess]) -> None:
    check_covering_equals_vanilla(servers, "quest", 400)


def test_quest_cuda_graphs_on_and_off_give_the_same_tokens(servers: dict[str, ServerProcess]) -> None:
    check_graphs_equal_eager(servers, "quest", 500)
