"""RetroInfer's index build and decode (sgl_sparse/kernels/retroinfer.py) against plain torch written here.

Small shapes: 2 KV heads x 2 query heads, head dim 32, page 16, 64-token segments (4 clusters each).
The Triton kernel's checks run when ``TRITON_INTERPRET=1`` was set before Triton was imported:
:func:`test_triton_kernel_under_the_interpreter` checks them in the session's interpreted run (tests/interpreted.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.kernels import pages
from sgl_sparse.kernels import retroinfer as ri

HKV, G, D, PAGE = 2, 2, 32, 16
POOL_PAGES = 96
SCALE = 1 / math.sqrt(D)


def _layout(retrieval: float = 0.018, estimation: float = 0.232, recent: int = 8, min_segments: int = 1) -> ri.Layout:
    return ri.Layout(base=16, seg=64, page=PAGE, recent=recent, min_segments=min_segments, retrieval=retrieval,
                     estimation=estimation)


def _batch(lens: list[int], seed: int = 0, clustered: bool = True):
    """A pool whose requests own random, scattered physical pages; keys drawn around a few directions
    (so clusters mean something) when ``clustered``."""
    g = torch.Generator().manual_seed(seed)
    slots = POOL_PAGES * PAGE
    if clustered:
        dirs = torch.randn(6, HKV, D, generator=g) * 2
        k = dirs[torch.randint(0, 6, (slots,), generator=g)] + 0.5 * torch.randn(slots, HKV, D, generator=g)
    else:
        k = torch.randn(slots, HKV, D, generator=g)
    v = torch.randn(slots, HKV, D, generator=g)
    width = max(lens) + PAGE
    req_to_token = torch.zeros(len(lens) + 1, width, dtype=torch.int32)
    pages = torch.randperm(POOL_PAGES - 1, generator=g) + 1  # page 0 stays the padding page
    used = 0
    for i, n in enumerate(lens):
        npg = -(-n // PAGE)
        mine = pages[used:used + npg]
        used += npg
        row = (mine[:, None] * PAGE + torch.arange(PAGE)[None, :]).flatten()[:n]
        req_to_token[i + 1, :n] = row.to(torch.int32)
    q = torch.randn(len(lens), HKV * G, D, generator=g)
    return q, k, v, req_to_token, torch.arange(1, len(lens) + 1), torch.tensor(lens, dtype=torch.int32)


def _build_all(k, v, req_to_token, rows, lens, layout, valid=None):
    store = ri.IndexStore.empty(k.shape[0], PAGE, HKV, D, torch.float32, "cpu")
    nseg = layout.num_segments(lens.long())
    max_seg = int(nseg.max())
    seg_valid = torch.zeros(len(lens), max(max_seg, 1), dtype=torch.int8)
    pairs = [(int(rows[i]), s) for i in range(len(lens)) for s in range(int(nseg[i]))
             if valid is None or valid[i][s]]
    for i in range(len(lens)):
        for s in range(int(nseg[i])):
            seg_valid[i, s] = 1 if valid is None or valid[i][s] else 0
    if pairs:
        ri.build_segments(store, k, v, req_to_token, torch.tensor([p[0] for p in pairs]),
                          torch.tensor([p[1] for p in pairs]), layout)
    return store, seg_valid, max(max_seg, 1)


def _run_both(q, k, v, store, req_to_token, rows, lens, seg_valid, layout, max_seg):
    scores = ri.cluster_scores_torch(q, store, req_to_token, rows, lens, seg_valid, layout, SCALE, max_seg)
    if INTERPRETED:
        got = ri.cluster_scores(q, store, req_to_token, rows, lens, seg_valid.contiguous(), layout, SCALE, max_seg)
        finite = scores.isfinite()
        assert torch.equal(finite, got.isfinite())
        torch.testing.assert_close(got[finite], scores[finite], atol=1e-5, rtol=1e-5)
    width = layout.max_ranked(int(lens.max()))
    ranked = ri.rank_clusters(scores, width)
    r, e = ri.row_budgets(lens, seg_valid, layout, max_seg)
    args = (q, k, v, store, req_to_token, rows, lens, seg_valid, ranked, r, e, layout, SCALE)
    fast = None
    if INTERPRETED:  # the served path: the Triton tiers (same sets, position order) into the Triton decode
        tiers = ri.rank_clusters_triton(scores, width, r, e, HKV)
        _assert_same_tiers(tiers, ranked, r, e, HKV)
        fast = ri.decode_attention(*args[:8], tiers, *args[9:], splits=3)
    return ri.decode_attention_torch(*args), fast, ranked, r, e


def _assert_same_tiers(tiers: torch.Tensor, ranked: torch.Tensor, r: torch.Tensor, e: torch.Tensor, hkv: int) -> None:
    """Row by row: the same retrieved set in ``[:r]`` and estimated set in ``[r:r + e]`` as the sorted ranking,
    each tier ascending with its ``-1`` after it, ``-1`` past both."""
    for row in range(tiers.shape[0]):
        nr, ne = int(r[row // hkv]), int(e[row // hkv])
        for lo, hi in ((0, nr), (nr, nr + ne)):
            want = sorted(x for x in ranked[row, lo:hi].tolist() if x >= 0)
            got = tiers[row, lo:hi].tolist()
            assert got == want + [-1] * (hi - lo - len(want)), (row, lo, hi, got, want)
        assert (tiers[row, nr + ne:] == -1).all()


def _dense(q, k, v, req_to_token, rows, lens):
    out = torch.empty_like(q)
    for i in range(len(lens)):
        slots = req_to_token[int(rows[i]), : int(lens[i])].long()
        for h in range(HKV):
            qq = q[i, h * G:(h + 1) * G]
            w = torch.softmax(qq @ k[slots, h].T * SCALE, dim=1)
            out[i, h * G:(h + 1) * G] = w @ v[slots, h]
    return out


def test_kmeans_partitions_each_segment_into_clusters_of_similar_keys() -> None:
    g = torch.Generator().manual_seed(1)
    dirs = torch.nn.functional.normalize(torch.randn(4, D, generator=g), dim=1) * 4
    label = torch.randint(0, 4, (3, 64), generator=g)
    label[:, [8, 24, 40, 56]] = torch.arange(4)  # the evenly spaced first centroids see every direction
    keys = dirs[label] + 0.05 * torch.randn(3, 64, D, generator=g)
    values = torch.randn(3, 64, D, generator=g)
    idx = ri.kmeans_segments(keys, values, clusters=4)
    assert int(idx.sizes.sum(dim=1).unique()) == 64
    for b in range(3):
        assert sorted(idx.order[b].tolist()) == list(range(64))
        groups = [idx.order[b, o:o + s].long() for o, s in zip(idx.offsets[b].tolist(), idx.sizes[b].tolist())]
        for c, members in enumerate(groups):
            if not len(members):
                continue
            assert members.tolist() == sorted(members.tolist())
            assert len(set(label[b, members].tolist())) == 1  # one direction per cluster
            torch.testing.assert_close(idx.centroids[b, c], keys[b, members].mean(0))
            torch.testing.assert_close(idx.value_sums[b, c], values[b, members].sum(0))
        assert sum(1 for m in groups if len(m)) == len(set(label[b].tolist()))


def test_retrieving_every_cluster_is_dense_attention() -> None:
    layout = _layout(retrieval=1.0, estimation=0.0)
    q, k, v, r2t, rows, lens = _batch([16 + 4 * 64 + 8 + 5, 16 + 2 * 64 + 8, 100, 7])
    store, seg_valid, max_seg = _build_all(k, v, r2t, rows, lens, layout)
    ref = _dense(q, k, v, r2t, rows, lens)
    torch_out, triton_out, _, r, e = _run_both(q, k, v, store, r2t, rows, lens, seg_valid, layout, max_seg)
    assert r.tolist() == [16, 8, 4, 0] and e.tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(torch_out, ref, atol=1e-5, rtol=1e-5)
    _close_if_run(triton_out, ref)


def test_estimating_single_token_clusters_is_dense_attention() -> None:
    """The estimation term by itself: with one member per cluster (centroid = key, value sum = value)
    an estimated cluster contributes exactly what its token would."""
    layout = ri.Layout(base=16, seg=16, page=1, recent=8, min_segments=1, retrieval=0.0, estimation=1.0)
    q, k, v, r2t, rows, lens = _batch([16 + 3 * 16 + 8 + 3], seed=2)
    store = ri.IndexStore.empty(k.shape[0], 1, HKV, D, torch.float32, "cpu")
    slots = r2t[1, 16:16 + 48].long()
    store.centroids[slots] = k[slots]
    store.value_sums[slots] = v[slots]
    store.sizes[slots] = 1
    store.offsets[slots] = (torch.arange(48) % 16)[:, None].to(torch.int32)
    store.order[slots] = (torch.arange(48) % 16)[:, None].to(torch.int16)
    seg_valid = torch.ones(1, 3, dtype=torch.int8)
    torch_out, triton_out, ranked, r, e = _run_both(q, k, v, store, r2t, rows, lens, seg_valid, layout, 3)
    assert r.tolist() == [1] and e.tolist() == [47]  # one retrieved (the minimum), every other estimated
    ref = _dense(q, k, v, r2t, rows, lens)
    torch.testing.assert_close(torch_out, ref, atol=1e-5, rtol=1e-5)
    _close_if_run(triton_out, ref)


def _reference(q, k, v, r2t, rows, lens, layout, valid):
    """RetroInfer's decode for each request from its keys and values in logical order, written from the
    method's definition (not from the store): cluster each usable segment, rank by summed softmax,
    read the top R exactly, estimate the next E, read everything else exactly."""
    out = torch.empty_like(q)
    c = layout.clusters_per_segment
    for i in range(len(lens)):
        n = int(lens[i])
        slots = r2t[int(rows[i]), :n].long()
        nseg = int(layout.num_segments(torch.tensor([n]))[0])
        segs = [s for s in range(nseg) if valid[i][s]]
        for h in range(HKV):
            qq = q[i, h * G:(h + 1) * G]
            clusters = []  # (centroid, value_sum, size, members as logical positions)
            for s in segs:
                start = layout.base + s * layout.seg
                ks, vs = k[slots[start:start + layout.seg], h], v[slots[start:start + layout.seg], h]
                idx = ri.kmeans_segments(ks[None], vs[None], c)
                for j in range(c):
                    o, z = int(idx.offsets[0, j]), int(idx.sizes[0, j])
                    clusters.append((idx.centroids[0, j], idx.value_sums[0, j], z,
                                     [start + int(t) for t in idx.order[0, o:o + z]]))
            total = len(clusters)
            n_ret = min(max(math.floor(total * layout.retrieval + 0.5), 1), total) if total else 0
            n_est = min(math.floor(total * layout.estimation + 0.5), total - n_ret) if total else 0
            live = [j for j, cl in enumerate(clusters) if cl[2] > 0]
            prob = torch.full((total,), float("-inf"))
            if live:
                logits = qq @ torch.stack([clusters[j][0] for j in live]).T * SCALE
                prob[live] = torch.softmax(logits, dim=1).sum(0)
            order = sorted(live, key=lambda j: -float(prob[j]))
            indexed = {p for s in segs for p in range(layout.base + s * layout.seg, layout.base + (s + 1) * layout.seg)}
            exact = [p for p in range(n) if p not in indexed]
            for j in order[:n_ret]:
                exact += clusters[j][3]
            est = order[n_ret:n_ret + n_est]
            logit = qq @ k[slots[exact], h].T * SCALE
            num = torch.exp(logit) @ v[slots[exact], h]
            den = torch.exp(logit).sum(1)
            for j in est:
                w = torch.exp(qq @ clusters[j][0] * SCALE)
                num += w[:, None] * clusters[j][1][None]
                den += w * clusters[j][2]
            out[i, h * G:(h + 1) * G] = num / den[:, None]
    return out


@pytest.mark.parametrize("valid", [None, [[True, False, True, True, True, True], [False, True, True, False]]])
def test_small_budget_matches_a_reference_written_from_the_definition(valid) -> None:
    """The default ratios over 6 and 4 segments (24 and 16 clusters: 1 retrieved and 6 or 4
    estimated a KV head), optionally with a segment whose index is not usable (read exactly)."""
    layout = _layout()
    lens = [16 + 6 * 64 + 8 + 11, 16 + 4 * 64 + 8 + 3]
    q, k, v, r2t, rows, lens_t = _batch(lens, seed=3)
    flags = valid or [[True] * 6, [True] * 4]
    store, seg_valid, max_seg = _build_all(k, v, r2t, rows, lens_t, layout, flags)
    torch_out, triton_out, _, r, e = _run_both(q, k, v, store, r2t, rows, lens_t, seg_valid, layout, max_seg)
    usable = [sum(f) * 4 for f in flags]
    assert r.tolist() == [1, 1] and e.tolist() == [math.floor(u * 0.232 + 0.5) for u in usable]
    ref = _reference(q, k, v, r2t, rows, lens_t, layout, flags)
    torch.testing.assert_close(torch_out, ref, atol=1e-5, rtol=1e-4)
    _close_if_run(triton_out, ref)
    dense = _dense(q, k, v, r2t, rows, lens_t)
    assert (torch_out - dense).abs().max() > 1e-3  # the budget does change what is read


def test_short_requests_are_dense() -> None:
    """Under ``min_segments`` no index is used: the whole request is read exactly."""
    layout = _layout(min_segments=3)
    q, k, v, r2t, rows, lens = _batch([16 + 2 * 64 + 8 + 1], seed=4)
    store, seg_valid, max_seg = _build_all(k, v, r2t, rows, lens, layout)
    seg_valid = torch.ones(1, 2, dtype=torch.int8)
    torch_out, triton_out, _, r, e = _run_both(q, k, v, store, r2t, rows, lens, seg_valid, layout, 2)
    assert r.tolist() == [0] and e.tolist() == [0]
    ref = _dense(q, k, v, r2t, rows, lens)
    torch.testing.assert_close(torch_out, ref, atol=1e-5, rtol=1e-5)
    _close_if_run(triton_out, ref)


def _close_if_run(out: torch.Tensor | None, ref: torch.Tensor) -> None:
    if out is not None:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="Triton kernel: run by test_triton_kernel_under_the_interpreter")
def test_group_probs_kernel_equals_torch() -> None:
    """Per row and query head the softmax over the row's usable clusters, summed over the group: rows with
    unusable clusters, a row with none (all ``-inf``) and a width past one chunk."""
    g = torch.Generator().manual_seed(5)
    rows, grp, width = 5, 4, ri.GROUP_CHUNK + 300
    logits = torch.randn(rows, grp, width, generator=g) * 3
    unusable = torch.rand(rows, width, generator=g) < 0.3
    unusable[2] = True
    unusable[3, ri.GROUP_CHUNK:] = True
    logits = logits.masked_fill(unusable[:, None, :], float("-inf"))
    want = ri._group_probs(logits)
    got = ri.group_probs(logits)
    assert torch.equal(got.isinf(), want.isinf()) and bool(got[2].isinf().all())
    torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="Triton kernel: run by test_triton_kernel_under_the_interpreter")
@pytest.mark.parametrize("width", [300, 512 + 188])  # rows in registers / re-read in chunks
def test_tiers_kernel_reads_the_same_clusters_as_a_sorted_top_k(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random scores (no ties) with unusable clusters; per request budgets covering every case: nothing, a
    row with fewer usable clusters than ``r``, than ``r + e``, no estimated tier, and plenty of both."""
    # Rows wider than SELECT_MAX_BLOCK are re-read in SELECT_CHUNK pieces: lowered, 700 clusters take two chunks
    # and a partial one (16,384 + 700 took four and a partial one at the defaults).
    monkeypatch.setattr(pages, "SELECT_MAX_BLOCK", 512)
    monkeypatch.setattr(pages, "SELECT_CHUNK", 256)
    launches: list[dict[str, int | bool]] = []

    def row_blocks(n: int) -> dict[str, int | bool]:
        launches.append(pages.row_blocks(n))
        return launches[-1]

    monkeypatch.setattr(ri, "row_blocks", row_blocks)
    g = torch.Generator().manual_seed(6)
    hkv = 2
    budgets = [(0, 0), (40, 10), (10, 400), (7, 0), (12, 200)]
    scores = torch.rand(len(budgets) * hkv, width, generator=g)
    scores[torch.rand(scores.shape, generator=g) < 0.2] = float("-inf")
    scores[0:2] = float("-inf")  # request 0: no usable cluster (r = e = 0 there, as row_budgets gives)
    scores[2:4, 30:] = float("-inf")  # request 1: ~24 usable, under r
    scores[4:6, 200:] = float("-inf")  # request 2: ~160 usable, between r and r + e
    r = torch.tensor([b[0] for b in budgets], dtype=torch.int32)
    e = torch.tensor([b[1] for b in budgets], dtype=torch.int32)
    k = 420
    ranked = ri.rank_clusters(scores, k)
    tiers = ri.rank_clusters_triton(scores, k, r, e, hkv)
    _assert_same_tiers(tiers, ranked, r, e, hkv)
    assert (tiers[2:4, :10] >= 0).sum() < 40 and (tiers[4:6, 10:410] >= 0).sum() < 800  # the short cases ran
    assert [b["ONE_BLOCK"] for b in launches] == [width == 300]  # the path the parameter names


@pytest.mark.skipif(not INTERPRETED, reason="Triton kernel: run by test_triton_kernel_under_the_interpreter")
def test_tiers_kernel_breaks_ties_by_position() -> None:
    scores = torch.zeros(2, 64)
    scores[1, 50] = 1.0
    tiers = ri.rank_clusters_triton(scores, 12, torch.tensor([3]), torch.tensor([5]), 2)
    assert tiers[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1, -1]
    assert tiers[1].tolist() == [0, 1, 50, 2, 3, 4, 5, 6, -1, -1, -1, -1]


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_triton_kernel_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
