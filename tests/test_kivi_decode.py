"""KIVI's page-aligned decode kernel (``kernels/kivi_attention.py::decode_attention``) at page sizes that take
each of its paths (8: two pages an iteration, each position's key scale gathered; 16, 32: several pages stacked,
or one page, its key scale read once), over rows that end mid-page, exactly on a page, inside their first page,
empty, and a batch whose rows leave most splits empty; against the store's torch path and against KIVI
quantize-dequantize-attend written here in plain torch. The head dims put a chunk (``D * bits / 8`` channels)
under 16 (the logits' broadcast path), at 16 or more (``tl.dot``), within one value group, and across two or four
of them (4 bits at 16 x 64 and 8 x 32; 8 x 64). Both forms of the loop (queries or keys as the dots' rows): the
keys-as-rows one at a subset that still takes each of its paths (pages of 8, 16 and 32; 2 and 4 bits; a chunk
under 16 and over a page's width), the interpreter being slow."""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.contract import KVGeometry
from sgl_sparse.kernels.splits import MAX_SPLITS, MIN_SPLITS, decode_splits
from sgl_sparse.registry import create_method

HKV, G, ROWS = 2, 2, 8


def _kivi_by_hand(k: torch.Tensor, v: torch.Tensor, bits: int, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI of a row ``[n, H, D]``: keys per channel over each whole page of ``gs`` tokens, values per token over
    ``gs`` channels, codes from the fp32 min/max and decoded with fp16 scale and zero (what the store keeps); the
    positions past the last whole page exact."""
    levels = 2**bits - 1
    whole = k.shape[0] // gs * gs

    def qdq(x: torch.Tensor, dim: int) -> torch.Tensor:
        lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
        step = (hi - lo) / levels
        codes = torch.round((x - lo) / torch.where(step > 0, step, torch.ones_like(step))).clamp(0, levels)
        return codes * step.half().float() + lo.half().float()

    n, h, d = k.shape
    kq = qdq(k[:whole].reshape(-1, gs, h, d), 1).reshape(whole, h, d)
    vq = qdq(v[:whole].reshape(whole, h, d // gs, gs), 3).reshape(whole, h, d)
    return torch.cat([kq, k[whole:]]), torch.cat([vq, v[whole:]])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[Hq, D]`` over ``k``/``v`` ``[n, Hkv, D]``; zeros over no key."""
    if k.shape[0] == 0:
        return torch.zeros_like(q)
    kk = k.repeat_interleave(G, dim=1)
    vv = v.repeat_interleave(G, dim=1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q, kk) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", w, vv)


SHAPES = [(8, 16), (16, 32), (32, 64), (16, 64), (8, 32), (8, 64)]  # (page size, head dim)
KEY_ROWS_CASES = [(2, 8, 16), (4, 8, 32), (2, 16, 32), (4, 32, 64)]  # (bits, page size, head dim)
CASES = [(bits, gs, d, False) for bits in (2, 4) for gs, d in SHAPES] + [(*c, True) for c in KEY_ROWS_CASES]


@pytest.mark.parametrize(("bits", "gs", "d", "key_rows"), CASES,
                         ids=[f"{b}bit-page{gs}-d{d}{'-key_rows' if kr else ''}" for b, gs, d, kr in CASES])
def test_page_aligned_decode_over_ragged_rows(bits: int, gs: int, d: int, key_rows: bool) -> None:
    if not INTERPRETED:
        pytest.skip("the kernel runs in the interpreted run")
    from sgl_sparse.kernels import kivi_attention

    lens = [3 * gs + 5, 2 * gs, gs - 3, 0, 1, 5 * gs - 1, gs]  # mid-page, on a page, < a page, empty, ...
    width = 6 * gs
    pages = sum(-(-n // gs) for n in lens) + 2
    store = create_method("kivi", {"bits": bits, "group_size": gs}).store
    store.allocate(KVGeometry(num_layers=1, num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=d, page_size=gs,
                              num_slots=pages * gs, dtype=torch.float32, device=torch.device("cpu"),
                              max_requests=ROWS))
    gen = torch.Generator().manual_seed(100 * bits + gs)
    free = (torch.randperm(pages - 1, generator=gen) + 1).tolist()  # rows' pages scattered, in no order
    r2t = torch.zeros(ROWS, width, dtype=torch.int32)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for row, n in enumerate(lens):
        pos = torch.arange(n)
        pg = torch.tensor([free.pop() for _ in range(-(-n // gs))], dtype=torch.long)
        slots = pg[pos // gs] * gs + pos % gs
        k = torch.randn(n, HKV, d, generator=gen) * torch.linspace(0.1, 4, d) + torch.linspace(-3, 3, d)
        v = torch.randn(n, HKV, d, generator=gen)
        if n:
            store.write(0, slots, k, v, torch.full((n,), row), decode=False)
        r2t[row, :n] = slots.to(torch.int32)
        kv.append((k, v))
    rpi = torch.arange(len(lens), dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), HKV * G, d, generator=gen)
    scale = 1 / math.sqrt(d)
    want = store.decode(0, q, r2t, rpi.long(), seq.long(), scale)
    for i, (k, v) in enumerate(kv):
        by_hand = _attend(q[i], *_kivi_by_hand(k, v, bits, gs), scale)
        torch.testing.assert_close(want[i], by_hand, atol=1e-4, rtol=1e-4)
    # The default splits (16: most of them past these rows' ends, empty), 3, and 1; pages of 16 or more also
    # 2 and 4 an iteration (their key scales stacked, kivi_attention._logits_stacked) and, keys as rows, 1.
    tiles = ((None, None), (3, None), (1, None), (3, 2), (None, 4), (1, 4))
    if key_rows:  # fewer: the splits' bounds are the other form's (shared code), the pages' paths are not
        tiles = ((None, None), (1, None), (3, 1), (3, 2))
    for (splits, pages), paired in zip(tiles, (True, False) * len(tiles)):  # value scales a load, or a group
        if pages and gs < 16:
            continue
        got = kivi_attention.decode_attention(q, *store._buffers(0), r2t, rpi, seq, scale, bits, gs, splits=splits,
                                              pages=pages, key_rows=key_rows, paired_scales=paired)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[3], torch.zeros_like(got[3]))  # the empty row


def test_decode_splits_grow_with_row_width_and_stay_within_bounds() -> None:
    assert decode_splits(48, 131072) == MAX_SPLITS  # 6 requests x 8 KV heads at 128K: 2K positions a program
    assert decode_splits(128, 131072) == 32  # 16 x 8: the grid held near 4K programs
    assert decode_splits(48, 64) == decode_splits(4096, 131072) == MIN_SPLITS  # never below the old 16
    assert decode_splits(0, 0) == MIN_SPLITS


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_decode_kernel_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
