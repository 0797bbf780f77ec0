"""Our Triton kernels on the GPU at serving shapes, against plain-torch references (no server).

The CPU suite runs the same kernels under ``TRITON_INTERPRET=1`` at small shapes; here they run compiled
at the shapes a 130K-context server gives them: ``req_to_token`` rows 131,072+ wide, batches of 30 with
CUDA-graph padding rows, FlashInfer's dtypes (int64 ``seq_lens``, int32 ``kv_indices``), and SnapKV's
scoring reading keys in place in a pool-sized key buffer through scattered slots.
"""

from __future__ import annotations

import torch

from sgl_sparse.integration.syncs import sync_debug
from sgl_sparse.kernels.compact import compact_kv_indices_reference, fill_compact_kv_indices
from sgl_sparse.kernels.window_scores import window_scores_per_head
from sgl_sparse.methods.eviction.base import per_head_scores_torch
from sgl_sparse.slots import SENTINEL_SLOT, write_sentinels

DEV = "cuda"


def _rows(n_rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    """A req_to_token table: row 0 padding (all sentinel), others a mix of evicted ranges and holes."""
    r2t = torch.randint(1, 2**30, (n_rows, width), generator=g, dtype=torch.int32)
    r2t[0] = 0
    for r in range(1, n_rows):
        kind = r % 4
        if kind == 1:  # SnapKV-like: sinks, scattered middle, recent tail
            keep = torch.rand(width, generator=g) < 0.06
            keep[:64] = True
            r2t[r, ~keep] = 0
        elif kind == 2:  # StreamingLLM-like: a long evicted range
            r2t[r, 64:width - 600] = 0
        elif kind == 3:
            r2t[r, :] = 0  # everything evicted (a fully evicted prefix)
    return r2t


def _no_sync():  # type: ignore[no-untyped-def]
    """The block must not wait for the GPU: the list build runs every decode step, and a host sync there
    stalls overlap scheduling (e.g. ``indptr[0] = 0`` is a blocking host-to-device copy)."""
    return sync_debug("error")


def test_sentinel_writes_do_not_sync() -> None:
    t = torch.arange(1, 1001, dtype=torch.int32, device=DEV)
    idx = torch.tensor([3, 5, 999], device=DEV)
    # Built before the no-sync block: a tensor made from a Python list is itself a host-to-device copy.
    rows, cols = torch.tensor([0], device=DEV), torch.tensor([7], device=DEV)
    with _no_sync():
        write_sentinels(t, idx)
        write_sentinels(t.view(10, 100), (rows, cols))
    assert t.cpu()[[3, 5, 7, 999]].tolist() == [SENTINEL_SLOT] * 4 and int((t == SENTINEL_SLOT).sum()) == 4


def test_compaction_at_130k_rows_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    width = 131_072 + 8
    r2t_cpu = _rows(40, width, g)
    r2t = r2t_cpu.to(DEV)
    rpi_list = list(range(1, 31)) + [0, 0]  # 30 requests + 2 CUDA-graph padding rows
    lens_list = [int(torch.randint(1, width, (1,), generator=g)) for _ in range(30)] + [1, 1]
    lens_list[3] = width  # a row filled to the table's width
    rpi = torch.tensor(rpi_list, dtype=torch.int64, device=DEV)
    for lens_dtype, idx_dtype in ((torch.int64, torch.int32), (torch.int32, torch.int64)):
        lens = torch.tensor(lens_list, dtype=lens_dtype, device=DEV)
        for min_one in (False, True):
            ref_ptr, ref_idx = compact_kv_indices_reference(r2t_cpu, rpi.cpu(), lens.cpu(), min_one=min_one)
            indptr = torch.zeros(len(rpi_list) + 1, dtype=torch.int32, device=DEV)
            indices = torch.full((int(lens.sum()),), -1, dtype=idx_dtype, device=DEV)
            with _no_sync():
                got = fill_compact_kv_indices(r2t, rpi, lens, indptr, indices, min_one=min_one)
            assert got.cpu().tolist() == ref_ptr.tolist()
            assert torch.equal(indices[: int(ref_ptr[-1])].cpu().long(), ref_idx.long())
            # From the decode table's counts (the same ones here): same lists, no mismatch counted.
            counts = (ref_ptr[1:] - ref_ptr[:-1]).to(torch.int32).to(DEV)
            mismatches = torch.zeros(1, dtype=torch.int64, device=DEV)
            indices2 = torch.full_like(indices, -1)
            indptr2 = torch.full_like(indptr, 7)  # the build writes indptr[0] too
            with _no_sync():
                got2 = fill_compact_kv_indices(r2t, rpi, lens, indptr2, indices2, min_one=min_one, counts=counts,
                                               mismatches=mismatches)
            assert torch.equal(got2, got) and torch.equal(indices2, indices) and int(mismatches) == 0


def test_window_scores_in_place_match_torch_at_a_serving_shape() -> None:
    """Llama-3-8B's attention shape (32 query heads, 8 KV heads, 128 dims), bf16, 8,192 retained keys at
    scattered slots of a 200K-slot key buffer, a 32-query window at the end of a 20K-token prompt."""
    g = torch.Generator(device=DEV).manual_seed(0)
    w, n_heads, n_kv, d, n, pool = 32, 32, 8, 128, 8192, 200_000
    q = torch.randn(w, n_heads, d, generator=g, device=DEV, dtype=torch.bfloat16)
    buf = torch.randn(pool, n_kv, d, generator=g, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(pool - 1, generator=g, device=DEV)[:n] + 1
    k_pos = torch.sort(torch.randperm(20_000, generator=g, device=DEV)[:n]).values
    k_pos[-w:] = torch.arange(20_000 - w, 20_000, device=DEV)
    k_pos = torch.sort(torch.unique(k_pos)).values
    slots = slots[: k_pos.numel()]
    q_pos = torch.arange(20_000 - w, 20_000, device=DEV)
    scale = d**-0.5
    got = window_scores_per_head(q, buf, q_pos, k_pos, scale, k_rows=slots)
    ref = per_head_scores_torch(q, buf[slots], q_pos, k_pos, scale)
    assert got.shape == ref.shape == (n_kv, k_pos.numel())
    # Each (query, head) row's probabilities sum to 1: 32 x 4 rows per KV head.
    assert torch.allclose(got.sum(1), torch.full((n_kv,), float(w * n_heads // n_kv), device=DEV), rtol=1e-3)
    assert torch.allclose(got, ref, atol=2e-3, rtol=2e-2), (got - ref).abs().max()
    # SnapKV's top-k over the summed scores agrees (up to near-ties at the cut: at most 1%).
    top = 1024
    a, b = (set(torch.topk(x.sum(0), top).indices.tolist()) for x in (got, ref))
    assert len(a & b) >= 0.99 * top, len(a & b)
