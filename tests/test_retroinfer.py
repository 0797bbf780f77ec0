"""RetroInfer as a method (sgl_sparse/methods/selection/retroinfer.py): config, the reference driver,
and the index's validity rules over a shared pool (builds, stamps, rewrites), against plain torch."""

from __future__ import annotations

import random

import pytest
import torch

from sgl_sparse import create_method
from sgl_sparse.config import SparseConfigError
from sgl_sparse.contract import KVGeometry, SelectorStep
from sgl_sparse.reference import ToyAttentionStack, run_request

SMALL = {"segment_tokens": 32, "cluster_size": 8, "min_index_tokens": 64, "recent_tokens": 8}


def test_config_defaults_and_errors() -> None:
    m = create_method("retroinfer")
    c = m.config
    assert (c.sink_tokens, c.recent_tokens, c.cluster_size, c.retrieval_ratio, c.estimation_ratio,
            c.min_index_tokens) == (4, 64, 16, 0.018, 0.232, 16384)
    lay = c.layout()
    assert (lay.base, lay.seg, lay.clusters_per_segment, lay.min_segments) == (16, 1024, 64, 16)
    for bad, field in (({"cluster_size": 12}, "cluster_size"), ({"segment_tokens": 40}, "segment_tokens"),
                       ({"retrieval_ratio": 0}, "retrieval_ratio"), ({"min_index_tokens": 512}, "min_index_tokens"),
                       ({"scoring": "best"}, "scoring"), ({"recent_tokens": 0}, "recent_tokens")):
        with pytest.raises(SparseConfigError, match=field):
            create_method("retroinfer", bad)


def test_reference_driver_every_cluster_read_is_dense_and_the_default_ratios_are_not() -> None:
    model = ToyAttentionStack(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16)
    rng = random.Random(0)
    tokens = [rng.randrange(0, 200) for _ in range(300)]
    dense = run_request(create_method("dense"), model, tokens, 250, 64).outputs
    full = create_method("retroinfer", {**SMALL, "retrieval_ratio": 1.0, "estimation_ratio": 0.0})
    torch.testing.assert_close(run_request(full, model, tokens, 250, 64).outputs, dense, atol=1e-5, rtol=1e-5)
    small = run_request(create_method("retroinfer", SMALL), model, tokens, 250, 64).outputs
    torch.testing.assert_close(small[:250], dense[:250])  # prefill stays dense
    assert (small[250:] - dense[250:]).abs().max() > 1e-2


def _pool(num_pages: int = 40, page: int = 8, hkv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(num_pages * page, hkv, d, generator=g)
    v = torch.randn(num_pages * page, hkv, d, generator=g)
    return k, v


def _selector(k: torch.Tensor, width: int = 200):
    sel = create_method("retroinfer", SMALL).selector
    sel.allocate(KVGeometry(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8,
                            num_slots=k.shape[0], dtype=torch.float32, device=torch.device("cpu")))
    r2t = torch.zeros(4, width, dtype=torch.int32)
    return sel, r2t


def _step(sel, r2t, k, v, rows: list[int], old: list[int], new: list[int]) -> None:
    sel.after_step(SelectorStep(torch.tensor(rows), torch.tensor(old), torch.tensor(new), r2t, lambda layer: (k, v)))


def test_segments_are_built_once_shared_as_they_are_and_invalidated_by_a_rewrite() -> None:
    """Layout: base 8, segments of 32 tokens (4 pages of 8). A's row uses pages 1-12; B shares A's first
    7 pages (its match ends inside segment 1) then has its own; C shares A's first 9 pages (segments 0
    and 1 whole)."""
    k, v = _pool()
    sel, r2t = _selector(k)
    page_rows = {1: list(range(1, 13)), 2: list(range(1, 8)) + list(range(20, 25)),
                 3: list(range(1, 10)) + [30, 31, 32]}
    for row, pages in page_rows.items():
        r2t[row, : 8 * len(pages)] = (torch.tensor(pages)[:, None] * 8 + torch.arange(8)[None, :]).flatten().int()
    lay = sel.layout
    assert lay.base == 8 and lay.min_segments == 2
    sel.on_kv_write(0, r2t[1, :96].long(), k[:96])
    _step(sel, r2t, k, v, [1], [0], [96])  # A: (96 - 8 - 8) // 32 = 2 segments
    valid = sel._valid(r2t, torch.tensor([1, 2, 3]), 2)
    assert valid[0].tolist() == [1, 1]
    # The index A built equals a build from A's keys alone (plain torch k-means of the same segment).
    from sgl_sparse.kernels.retroinfer import kmeans_segments
    seg1 = r2t[1, 40:72].long()
    idx = kmeans_segments(k[seg1].transpose(0, 1), v[seg1].transpose(0, 1), 4)
    pages = (r2t[1, 40:72:8].long() // 8)
    store = sel.stores[1]
    torch.testing.assert_close(store.centroids[pages].transpose(0, 1), idx.centroids)
    assert torch.equal(store.sizes[pages].transpose(0, 1), idx.sizes)

    # B: its own pages are written, then its step completes both segments. Segment 0 (A's pages) is
    # valid as it is; segment 1 mixes A's pages 6-7 with B's new ones: never rebuilt over A's pages.
    before = store.centroids[6].clone()
    sel.on_kv_write(0, r2t[2, 56:96].long(), k[:40])
    _step(sel, r2t, k, v, [2], [56], [96])
    assert sel._valid(r2t, torch.tensor([2]), 2)[0].tolist() == [1, 0]
    assert torch.equal(store.centroids[6], before)
    assert sel._valid(r2t, torch.tensor([1]), 2)[0].tolist() == [1, 1]  # A's index untouched
    # C shares both of A's segments: valid without a build.
    assert sel._valid(r2t, torch.tensor([3]), 2)[0].tolist() == [1, 1]
    # A page rewritten (freed and reused for new content) voids the segment it was in.
    sel.on_kv_write(0, torch.arange(6 * 8, 6 * 8 + 3), k[:3])
    assert sel._valid(r2t, torch.tensor([1]), 2)[0].tolist() == [1, 0]
