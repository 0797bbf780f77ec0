"""FP8 KV decode and prefix attention (sgl_sparse/kernels/fp8_attention.py) against plain torch written here.

The Triton kernel's checks run when ``TRITON_INTERPRET=1`` was set before Triton was imported:
:func:`test_triton_kernel_under_the_interpreter` checks them in the session's interpreted run (tests/interpreted.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.kernels import fp8_attention as fa
from sgl_sparse.kernels import quant

HKV, G, D = 2, 3, 32
SLOTS = 400
SCALE = 1 / math.sqrt(D)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """Plain softmax attention of each request's query heads over its rows' bf16 K/V."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i, slots in enumerate(rows):
        if len(slots) == 0:
            continue
        kk = k[slots].float().repeat_interleave(G, dim=1)  # [n, Hq, D]
        vv = v[slots].float().repeat_interleave(G, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), kk) * SCALE, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", w, vv)
    return out


def _batch(lens: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, HKV, D, generator=g) * torch.logspace(-3, 0, SLOTS)[:, None, None]  # tiny to unit
    v = torch.randn(SLOTS, HKV, D, generator=g)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    r2t = torch.zeros(len(lens) + 1, 128, dtype=torch.int32)
    perm = torch.randperm(SLOTS, generator=g)
    rows, at = [], 0
    for i, n in enumerate(lens):
        rows.append(perm[at: at + n].long())
        r2t[i + 1, :n] = perm[at: at + n].to(torch.int32)  # row 0 unused: the pool indices are data
        at += n
    q = torch.randn(len(lens), HKV * G, D, generator=g).to(torch.bfloat16)
    kc, ks = quant.fp8_quantize(k)
    vc, vs = quant.fp8_quantize(v)
    rpi = torch.arange(1, len(lens) + 1, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    args = (q, kc.view(torch.uint8), ks, vc.view(torch.uint8), vs, r2t, rpi, seq, SCALE)
    return args, (q, k, v, rows)


@pytest.mark.parametrize("lens", [[37, 128, 1], [0, 90], [5]])
def test_reference_is_dense_attention_within_fp8_error_and_the_kernel_equals_it(lens: list[int]) -> None:
    args, (q, k, v, rows) = _batch(lens, seed=len(lens))
    ref = fa.decode_attention_torch(*args)
    dense = _dense(q, k, v, rows)
    # E4M3 keeps ~4 significant bits: outputs (convex mixes of values ~N(0, 1)) within a few percent
    assert (ref.float() - dense).abs().max() < 0.1
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(ref[i], torch.zeros_like(ref[i]))
    if INTERPRETED:
        got = fa.decode_attention(*args, splits=3)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)  # bf16 output rounding


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
def test_every_finite_e4m3_code_decodes_as_torch_does() -> None:
    # one token per code: keys carry a one-hot query's code, so the kernel's logit is the decoded value
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    n = codes.numel()
    k = torch.zeros(n, 1, 16, dtype=torch.uint8)
    k[:, 0, 0] = codes
    v = torch.zeros(n, 1, 16, dtype=torch.uint8)
    v[:, 0, 0] = codes
    ones = torch.ones(n, 1)
    r2t = torch.arange(n, dtype=torch.int32)[None]
    want = codes.view(torch.float8_e4m3fn).float()
    for j in range(n):
        # attend one token at a time: the output is exactly that token's value
        seq = torch.tensor([1], dtype=torch.int32)
        row = r2t[:, j:j + 1].contiguous()
        q = torch.zeros(1, 1, 16)
        out = fa.decode_attention(q, k, ones, v, ones, row, torch.tensor([0], dtype=torch.int32), seq, 1.0, splits=1)
        assert out[0, 0, 0].item() == want[j].item(), (int(codes[j]), out[0, 0, 0].item(), want[j].item())


def _prefix_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo: list[int], rows: list[torch.Tensor]):
    """Each request's new-token queries over its prefix rows' bf16 K/V, no mask: (output, natural lse)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:2], float("-inf"))
    for i, slots in enumerate(rows):
        q0, q1 = qo[i], qo[i + 1]
        if q1 == q0 or len(slots) == 0:
            continue
        kk = k[slots].float().repeat_interleave(G, dim=1)
        vv = v[slots].float().repeat_interleave(G, dim=1)
        logits = torch.einsum("thd,nhd->thn", q[q0:q1].float(), kk) * SCALE
        lse[q0:q1] = torch.logsumexp(logits, dim=-1)
        out[q0:q1] = torch.einsum("thn,nhd->thd", torch.softmax(logits, dim=-1), vv)
    return out, lse


@pytest.mark.parametrize(("new", "prefix"), [([3, 40, 1], [50, 0, 130]), ([17], [9]), ([0, 5], [20, 64])])
def test_prefix_attention_is_dense_over_the_prefix_and_the_kernel_equals_its_reference(new: list[int],
                                                                                      prefix: list[int]) -> None:
    g = torch.Generator().manual_seed(sum(new) + sum(prefix))
    k = torch.randn(SLOTS, HKV, D, generator=g).to(torch.bfloat16)
    v = torch.randn(SLOTS, HKV, D, generator=g).to(torch.bfloat16)
    perm = torch.randperm(SLOTS, generator=g)
    rows, at = [], 0
    for n in prefix:
        rows.append(perm[at: at + n].long())
        at += n
    qo = [0]
    for n in new:
        qo.append(qo[-1] + n)
    q = torch.randn(qo[-1], HKV * G, D, generator=g).to(torch.bfloat16)
    r2t = torch.zeros(len(prefix) + 1, 256, dtype=torch.int32)  # row 0 unused: the pool indices are data
    for i, slots in enumerate(rows):
        r2t[i + 1, :len(slots)] = slots.to(torch.int32)
    kc, ks = quant.fp8_quantize(k)
    vc, vs = quant.fp8_quantize(v)
    args = (q, kc.view(torch.uint8), ks, vc.view(torch.uint8), vs, torch.tensor(qo, dtype=torch.int32), r2t,
            torch.arange(1, len(prefix) + 1, dtype=torch.int32), torch.tensor(prefix, dtype=torch.int32), SCALE)
    ref, ref_lse = fa.prefix_attention_torch(*args)
    dense, dense_lse = _prefix_dense(q, k, v, qo, rows)
    assert (ref.float() - dense).abs().max() < 0.1
    assert torch.equal(ref_lse.isinf(), dense_lse.isinf())  # -inf exactly where the prefix is empty
    fin = dense_lse.isfinite()
    assert (ref_lse[fin] - dense_lse[fin]).abs().max() < 0.1
    if INTERPRETED:
        got, got_lse = fa.prefix_attention(*args, extend_lens=new, block_m=4, block_n=16)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got_lse, ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
def test_the_decode_kernel_reads_compacted_lists_as_rows() -> None:
    """A composition on CUDA: the decode kernel over FlashInfer-style compacted lists (each request's live slots,
    flat; ``store_attention.flat_rows``), a row width under a list's end, a padding row of one slot: each request's
    output is attention over exactly its list."""
    from sgl_sparse.integration.store_attention import flat_rows

    gen = torch.Generator().manual_seed(11)
    hkv, g, d, n_slots = 2, 2, 16, 200
    kc, ks = quant.fp8_quantize(torch.randn(n_slots, hkv, d, generator=gen))
    vc, vs = quant.fp8_quantize(torch.randn(n_slots, hkv, d, generator=gen))
    kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    lists = [torch.randperm(n_slots - 1, generator=gen)[:n] + 1 for n in (37, 5, 60)]
    indices = torch.cat([*lists, torch.zeros(1, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)]).int()
    indptr = torch.tensor([0, 37, 42, 102, 103], dtype=torch.int32)  # the last: a padding row (one slot)
    rows = flat_rows(indptr, indices, 4, width=64)
    assert rows.table.shape == (1, 64) and rows.lens.tolist() == [37, 5, 60, 1]
    q = torch.randn(4, hkv * g, d, generator=gen)
    scale = 1 / math.sqrt(d)
    got = fa.decode_attention(q, kc, ks, vc, vs, rows.table, rows.indices, rows.lens, scale)
    r2t = torch.zeros(3, 64, dtype=torch.int32)
    for i, slots in enumerate(lists):
        r2t[i, :slots.numel()] = slots.int()
    want = fa.decode_attention_torch(q[:3], kc, ks, vc, vs, r2t, torch.arange(3), torch.tensor([37, 5, 60]), scale)
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_triton_kernel_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
