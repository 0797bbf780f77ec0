"""Quest's kernels (sgl_sparse/kernels/quest.py) against plain-torch references written here.

The Triton kernels run under TRITON_INTERPRET=1 in a subprocess (the interpreter must be set before
triton is imported); the torch paths (the CPU server's) run in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from sgl_sparse.kernels import pages, quest

PS, HKV, G, D = 4, 2, 2, 16


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


def test_triton_kernels_match_torch_paths() -> None:
    code = textwrap.dedent("""
        import torch
        from sgl_sparse.kernels import pages, quest
        import tests.test_quest_kernels as t
        quest.BLOCK_PAGES = 2; quest.PROGRAMS_PER_ROW = 3   # several blocks per program at small shapes
        k_buf, r2t, kmin, kmax, rpi, seq, q = t._setup(seed=3)
        for num_sel, sink, recent in ((4, 1, 1), (3, 0, 2), (16, 1, 1)):
            ref = torch.empty(len(seq) * t.HKV, 20)
            quest.score_pages_torch(q, kmin, kmax, r2t, rpi, seq, ref, t.PS, sink, recent)
            got = torch.full_like(ref, 7.0)
            quest.score_pages(q, kmin, kmax, r2t, rpi, seq, got, t.PS, sink, recent)
            assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
            sel = pages.select_pages(got, num_sel)
            lens = pages.selected_lens(seq.long(), t.PS, num_sel).repeat_interleave(t.HKV)
            indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
            indptr[1:] = torch.cumsum(lens, 0)
            out = torch.full((int(indptr[-1]) + 3,), -1, dtype=torch.int32)
            pages.expand_pages(sel, r2t, rpi, seq, indptr, out, t.PS)
            _, ref_lists = t._reference(k_buf, r2t, rpi, seq, q, num_sel, sink, recent)
            assert out[: int(indptr[-1])].tolist() == [s for x in ref_lists for s in x]
            assert out[int(indptr[-1]):].tolist() == [-1] * 3   # nothing written past the lists
        print("ok")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-4000:]
