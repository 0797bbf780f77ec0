"""Decode attention over per-layer kept sets (sgl_sparse/kernels/layer_sets.py) against plain torch written here:
a mask over each row's logical positions, softmax over what the mask lets through.

The Triton kernel's checks run when ``TRITON_INTERPRET=1`` was set before Triton was imported:
:func:`test_triton_kernel_under_the_interpreter` checks them in the session's interpreted run (tests/interpreted.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.kernels import layer_sets as ls

HKV, G, D = 2, 3, 32
SLOTS, WIDTH, W = 600, 160, 48
SCALE = 1 / math.sqrt(D)


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r2t: torch.Tensor, rpi: torch.Tensor,
            seq: torch.Tensor, reads: list[torch.Tensor]) -> torch.Tensor:
    """Each request's query heads over the live slots at the positions ``reads[i]`` (bool over positions) marks."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i in range(q.shape[0]):
        n = int(seq[i])
        row = r2t[int(rpi[i]), :n].long()
        mask = reads[i][:n] & (row != 0)
        if not mask.any():
            continue
        slots = row[mask]
        kk = k[slots].float().repeat_interleave(G, dim=1)
        vv = v[slots].float().repeat_interleave(G, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), kk) * SCALE, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", w, vv)
    return out


def _case(seed: int):
    """Four requests in rows 1..4 (row 0 unused: rows are data): a selected row with evicted positions (sentinels)
    outside its union, a row whose set lists a pruned position, a row with no set (reads every live position), and
    a row whose tail is past its length (a CUDA-graph padding row reads its set only)."""
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(SLOTS, HKV, D, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(SLOTS, HKV, D, generator=g).to(torch.bfloat16)
    lens = [130, 77, 41, 1]
    r2t = torch.zeros(5, WIDTH, dtype=torch.int32)
    perm = torch.randperm(SLOTS - 1, generator=g) + 1
    keep = torch.zeros(5, W, dtype=torch.int32)
    count = torch.zeros(5, dtype=torch.int32)
    tail = torch.zeros(5, dtype=torch.int32)
    reads = []
    at = 0
    for i, n in enumerate(lens):
        row = i + 1
        live = max(n, 20)  # the padding row's row holds another request's 20 positions; it reads 1
        r2t[row, :live] = perm[at:at + live].int()
        at += live
        read = torch.zeros(WIDTH, dtype=torch.bool)
        if i in (0, 1, 3):
            t = {0: 100, 1: 60, 3: 20}[i]
            u = min(40, t)
            union = torch.randperm(t, generator=g)[:u].sort().values
            gone = torch.ones(t, dtype=torch.bool)
            gone[union] = False
            r2t[row, :t][gone] = 0  # evicted: no layer keeps them
            mine = union[torch.randperm(u, generator=g)[: min(u - 5, 25 + 5 * i)]].sort().values
            if i == 1:
                r2t[row, int(mine[3])] = 0  # pruned after the selection: its set still lists it
            keep[row, :mine.numel()] = mine.int()
            count[row], tail[row] = mine.numel(), t
            read[mine] = True
            read[t:] = True
        else:
            read[:] = True
        reads.append(read)
    q = torch.randn(len(lens), HKV * G, D, generator=g).to(torch.bfloat16)
    rpi = torch.arange(1, len(lens) + 1, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    return (q, k, v, r2t, rpi, seq, keep, count, tail, SCALE), reads


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_reads_the_layer_set_and_the_tail_and_the_kernel_equals_it(seed: int) -> None:
    args, reads = _case(seed)
    q, k, v, r2t, rpi, seq = args[:6]
    want = _masked(q, k, v, r2t, rpi, seq, reads)
    ref = ls.decode_attention_torch(*args)
    torch.testing.assert_close(ref.float(), want, atol=1e-2, rtol=1e-2)  # bf16 output rounding
    if INTERPRETED:
        for splits in (1, 3):
            got = ls.decode_attention(*args, splits=splits)
            torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_a_row_without_a_set_is_dense_attention_over_its_live_slots() -> None:
    args, _ = _case(2)
    q, k, v, r2t, rpi, seq, keep, count, tail, scale = args
    # Row 3 (index 2) has no set: every position of the row, as a dense decode reads it.
    every = [torch.ones(WIDTH, dtype=torch.bool) for _ in range(q.shape[0])]
    dense = _masked(q, k, v, r2t, rpi, seq, every)
    ref = ls.decode_attention_torch(*args)
    torch.testing.assert_close(ref[2].float(), dense[2], atol=1e-2, rtol=1e-2)
    # and a set that lists every position before a tail at the row's end reads the same
    n = int(seq[2])
    keep2, count2, tail2 = keep.clone(), count.clone(), tail.clone()
    keep2[3, :n] = torch.arange(n, dtype=torch.int32)
    count2[3], tail2[3] = n, n
    full = ls.decode_attention_torch(q, k, v, r2t, rpi, seq, keep2, count2, tail2, scale)
    torch.testing.assert_close(full[2].float(), dense[2], atol=1e-2, rtol=1e-2)
    if INTERPRETED:
        got = ls.decode_attention(q, k, v, r2t, rpi, seq, keep2, count2, tail2, scale, splits=2)
        torch.testing.assert_close(got[2].float(), dense[2], atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_triton_kernel_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
