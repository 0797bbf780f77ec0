"""Quest's kernels (sgl_sparse/kernels/quest.py) against plain-torch references written here.

The Triton kernels' tests run when TRITON_INTERPRET=1 was set before triton was imported:
:func:`test_triton_kernels_under_the_interpreter` checks them in the session's interpreted run
(tests/interpreted.py); the torch paths (the CPU server's) run in every run.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.kernels import pages, quest
from sgl_sparse.methods.selection.quest import QuestConfig, QuestSelector

PS, HKV, G, D = 4, 2, 2, 16
only_interpreted = pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")


def _setup(seed: int = 0, lens: tuple[int, ...] = (37, 64, 5, 1)):
    """A paged pool: each request's logical page j lives in a random physical page (never page 0);
    its keys are written to the summaries in random chunks, over stale garbage."""
    g = torch.Generator().manual_seed(seed)
    num_pages, width = 64, 64
    k_buf = torch.randn(num_pages * PS, HKV, D, generator=g)
    r2t = torch.zeros(len(lens) + 1, width, dtype=torch.int32)
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    kmin = torch.randn(num_pages, HKV, D, generator=g)  # stale: must be reset by each page's first write
    kmax = torch.randn(num_pages, HKV, D, generator=g)
    for row, n in enumerate(lens, start=1):
        pages = [free.pop() for _ in range((n + PS - 1) // PS)]
        pos = torch.arange(n)
        r2t[row, :n] = (torch.tensor(pages)[pos // PS] * PS + pos % PS).to(torch.int32)
        start = 0
        while start < n:
            end = min(n, start + int(torch.randint(1, 9, (1,), generator=g)))
            loc = r2t[row, start:end].long()
            quest.update_page_summaries(kmin, kmax, loc, k_buf[loc], PS)
            # A CUDA-graph padding row writes slot 0 beside the real tokens.
            quest.update_page_summaries(kmin, kmax, torch.zeros(1, dtype=torch.long), k_buf[:1], PS)
            start = end
    rpi = torch.arange(1, len(lens) + 1)
    seq = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), HKV * G, D, generator=g)
    return k_buf, r2t, kmin, kmax, rpi, seq, q


def _reference(k_buf, r2t, rpi, seq, q, num_sel, sink, recent):
    """Per request and KV head: page bounds from the keys themselves, the top pages, their slots."""
    sel, lists = [], []
    for b, (row, n) in enumerate(zip(rpi.tolist(), seq.tolist())):
        npages = (n + PS - 1) // PS
        for h in range(HKV):
            scores = []
            for p in range(npages):
                slots = r2t[row, p * PS: min(n, (p + 1) * PS)].long()
                lo, hi = k_buf[slots, h].min(0).values, k_buf[slots, h].max(0).values
                s = max(float(torch.maximum(q[b, h * G + gi] * lo, q[b, h * G + gi] * hi).sum()) for gi in range(G))
                forced = p < sink or p >= npages - recent
                scores.append((float("inf") if forced else s, p))
            chosen = sorted(p for _, p in sorted(scores, reverse=True)[:num_sel])
            sel.append(chosen)
            lists.append([int(r2t[row, pos]) * HKV + h for p in chosen for pos in range(p * PS, min(n, (p + 1) * PS))])
    return sel, lists


def test_summaries_are_page_min_max() -> None:
    k_buf, r2t, kmin, kmax, rpi, seq, _ = _setup()
    for row, n in zip(rpi.tolist(), seq.tolist()):
        for p in range((n + PS - 1) // PS):
            slots = r2t[row, p * PS: min(n, (p + 1) * PS)].long()
            phys = int(slots[0]) // PS
            assert torch.equal(kmin[phys], k_buf[slots].min(0).values)
            assert torch.equal(kmax[phys], k_buf[slots].max(0).values)


def test_torch_scores_select_and_lists_match_reference() -> None:
    k_buf, r2t, kmin, kmax, rpi, seq, q = _setup(seed=1)
    for num_sel, sink, recent in ((4, 1, 1), (3, 0, 2), (16, 1, 1), (2, 1, 1)):
        scores = torch.empty(len(seq) * HKV, 20)
        quest.score_pages_torch(q, kmin, kmax, r2t, rpi, seq, scores, PS, sink, recent)
        sel = pages.select_pages(scores, num_sel)
        ref_sel, ref_lists = _reference(k_buf, r2t, rpi, seq, q, num_sel, sink, recent)
        got = [[p for p in r if p < scores.shape[1]] for r in sel.tolist()]
        assert got == ref_sel, (num_sel, sink, recent)
        lens = pages.selected_lens(seq.long(), PS, num_sel)
        assert [len(x) for x in ref_lists] == lens.repeat_interleave(HKV).tolist()
        mask = pages.selected_positions_mask(sel, seq.long(), HKV, PS, r2t.shape[1])
        for b, row in enumerate(rpi.tolist()):
            for h in range(HKV):
                slots = (r2t[row][mask[b, h]].long() * HKV + h).tolist()
                assert slots == ref_lists[b * HKV + h]


def test_budget_covering_the_context_selects_every_page() -> None:
    """A budget >= the context selects all pages in order: the lists are the dense rows."""
    k_buf, r2t, kmin, kmax, rpi, seq, q = _setup(seed=2)
    scores = torch.empty(len(seq) * HKV, 16)
    quest.score_pages_torch(q, kmin, kmax, r2t, rpi, seq, scores, PS, 1, 1)
    sel = pages.select_pages(scores, 16)
    mask = pages.selected_positions_mask(sel, seq.long(), HKV, PS, r2t.shape[1])
    pos = torch.arange(r2t.shape[1])
    assert torch.equal(mask, (pos[None, None, :] < seq[:, None, None]).expand_as(mask))


@only_interpreted
def test_triton_kernels_match_torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    # several blocks a program at small shapes
    for name, value in (("BLOCK_PAGES", 2), ("PROGRAMS_PER_ROW", 3), ("MIN_PROGRAMS_PER_ROW", 3)):
        monkeypatch.setattr(quest, name, value)
    k_buf, r2t, kmin, kmax, rpi, seq, q = _setup(seed=3)
    for num_sel, sink, recent in ((4, 1, 1), (3, 0, 2), (16, 1, 1)):
        ref = torch.empty(len(seq) * HKV, 20)
        quest.score_pages_torch(q, kmin, kmax, r2t, rpi, seq, ref, PS, sink, recent)
        got = torch.full_like(ref, 7.0)
        quest.score_pages(q, kmin, kmax, r2t, rpi, seq, got, PS, sink, recent, mma=False)
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
        # the tensor-core form: q+ . max + q- . min, the same bounds
        mma = torch.full_like(ref, 7.0)
        quest.score_pages(q, kmin, kmax, r2t, rpi, seq, mma, PS, sink, recent, mma=True)
        assert torch.allclose(mma, ref, atol=1e-5), (mma - ref).abs().max()
        sel = pages.select_pages(got, num_sel)
        lens = pages.selected_lens(seq.long(), PS, num_sel).repeat_interleave(HKV)
        indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(lens, 0)
        out = torch.full((int(indptr[-1]) + 3,), -1, dtype=torch.int32)
        pages.expand_pages(sel, r2t, rpi, seq, indptr, out, PS)
        _, ref_lists = _reference(k_buf, r2t, rpi, seq, q, num_sel, sink, recent)
        assert out[: int(indptr[-1])].tolist() == [s for x in ref_lists for s in x]
        assert out[int(indptr[-1]):].tolist() == [-1] * 3   # nothing written past the lists


def _stable_topk(scores: torch.Tensor, k: int, counts: torch.Tensor) -> torch.Tensor:
    """Per row, the ``k`` best of the first ``counts[r]`` entries above ``-inf``, ties to the earliest
    position (a stable sort by ``(-score, position)``), ascending; unused entries ``scores.shape[1]``."""
    rows, width = scores.shape
    out = torch.full((rows, min(k, width)), width, dtype=torch.long)
    for r in range(rows):
        s = scores[r, : int(counts[r])]
        order = torch.sort(-s, stable=True).indices
        chosen = order[s[order] > float("-inf")][:k]
        out[r, : chosen.numel()] = torch.sort(chosen).values
    return out


def _select_cases(seed: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(scores, k, counts) with distinct finite scores, forced (+inf) and absent (-inf) entries, rows with
    fewer real entries than k and with none, k > width, width 1; past a row's count, garbage (NaN, +inf,
    large values) that a kernel reading it would select."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for width, k, rows in ((13, 4, 6), (21, 7, 4), (1, 1, 3), (9, 12, 4), (24, 24, 3)):
        scores = torch.randperm(rows * width, generator=g).float().view(rows, width) - rows * width / 2
        counts = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
        counts[0], counts[-1] = width, 0
        scores[0, :2] = float("inf")  # forced, e.g. sink pages
        scores[1 % rows, -3:] = float("inf")  # forced, e.g. recent pages
        scores[2 % rows, ::2] = float("-inf")
        pos = torch.arange(width)
        garbage = torch.tensor([float("nan"), float("inf"), 1e30])[pos % 3]
        scores = torch.where(pos[None, :] < counts[:, None], scores, garbage)
        cases.append((scores, k, counts))
    return cases


def test_stable_topk_reference_matches_select_pages() -> None:
    """The test's reference is the torch path wherever the torch path's rows are -inf past their counts."""
    for scores, k, counts in _select_cases(seed=4):
        pos = torch.arange(scores.shape[1])
        padded = torch.where(pos[None, :] < counts[:, None], scores, float("-inf"))
        assert torch.equal(pages.select_pages(padded, k), _stable_topk(scores, k, counts))


@only_interpreted
def test_triton_select_matches_torch_and_takes_earliest_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(5)
    # Rows held in registers (one block, width not a power of two), then re-read in 8-entry chunks.
    for max_block, chunk in ((pages.SELECT_MAX_BLOCK, pages.SELECT_CHUNK), (8, 8)):
        monkeypatch.setattr(pages, "SELECT_MAX_BLOCK", max_block)
        monkeypatch.setattr(pages, "SELECT_CHUNK", chunk)
        for scores, k, counts in _select_cases(seed=4):
            got = pages.select_pages_triton(scores, k, counts)
            assert torch.equal(got, _stable_topk(scores, k, counts)), (scores, k, counts, got)
            # Ties (few distinct values, -0.0 == 0.0 among them): the earliest positions win.
            ties = torch.tensor([0.0, -0.0, 1.0, -2.0, float("inf"), float("-inf")])[
                torch.randint(0, 6, scores.shape, generator=g)]
            got = pages.select_pages_triton(ties, k, counts)
            assert torch.equal(got, _stable_topk(ties, k, counts)), (ties, k, counts, got)
    # Counts as sequence lengths shared by rows_per_count rows, in pages of 4 positions.
    monkeypatch.setattr(pages, "SELECT_MAX_BLOCK", 16384)
    monkeypatch.setattr(pages, "SELECT_CHUNK", 4096)
    for scores, k, counts in _select_cases(seed=6):
        if scores.shape[0] % 2:
            continue
        pair = counts.view(-1, 2).min(dim=1).values  # both rows of a pair: the smaller count (no garbage read)
        lens = (pair * 4 - 3).clamp(min=0)  # ceil(lens / 4) == pair
        want = pair.repeat_interleave(2)
        got = pages.select_pages_triton(scores, k, lens, rows_per_count=2, page_size=4)
        assert torch.equal(got, _stable_topk(scores, k, want)), (scores, k, lens, got)


@only_interpreted
def test_quest_selector_triton_path_matches_torch_path() -> None:
    _, r2t, kmin, kmax, rpi, seq, q = _setup(seed=6)
    for scoring in ("bounds", "random"):
        cfg = QuestConfig(page_size=PS, token_budget=6 * PS, sink_tokens=PS, recent_tokens=2 * PS,
                          dense_layers=0, scoring=scoring)
        sel = QuestSelector(cfg)
        sel.kmin[0], sel.kmax[0] = kmin, kmax
        got = []
        for use_triton in (False, True):
            sel.use_triton = sel.triton_select = use_triton
            torch.manual_seed(0)  # the same random scores on both paths
            got.append(sel.select(0, q, r2t, rpi, seq))
        assert torch.equal(got[0], got[1]), (scoring, got)


@only_interpreted
def test_decode_summary_kernel_equals_page_min_max() -> None:
    """Decode-step writes (one token per request a step, plus two CUDA-graph padding rows at slot 0) through
    the in-place Triton kernel give every real page its keys' exact min and max, over stale garbage, and
    equal the general path's summaries."""
    g = torch.Generator().manual_seed(7)
    lens = [13, 9, 1, 16]
    num_pages = 24
    k_buf = torch.randn(num_pages * PS, HKV, D, generator=g).to(torch.bfloat16)
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    slots = []
    for n in lens:
        pg = torch.tensor([free.pop() for _ in range(-(-n // PS))])
        pos = torch.arange(n)
        slots.append(pg[pos // PS] * PS + pos % PS)
    stale = torch.randn(num_pages, HKV, D, generator=g).to(torch.bfloat16)
    kmin, kmax = stale.clone(), stale.clone()
    rmin, rmax = stale.clone(), stale.clone()
    for step in range(max(lens)):
        loc = torch.tensor([int(s[step]) for s in slots if step < len(s)] + [0, 0])
        quest.update_decode_summaries(kmin, kmax, loc, k_buf[loc], PS)
        quest.update_page_summaries(rmin, rmax, loc, k_buf[loc], PS)
    for s in slots:
        for p in range(0, len(s), PS):
            page = s[p:p + PS]
            phys = int(page[0]) // PS
            assert torch.equal(kmin[phys], k_buf[page].min(0).values), phys
            assert torch.equal(kmax[phys], k_buf[page].max(0).values), phys
            assert torch.equal(kmin[phys], rmin[phys]) and torch.equal(kmax[phys], rmax[phys])


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_triton_kernels_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
