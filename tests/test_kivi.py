"""KIVI's layout (sgl_sparse/methods/quantization/kivi.py) against KIVI's quantizers applied by hand here.

A request's positions in whole pages must read back as KIVI's per-channel keys / per-token values of that
page (``kernels/quant.py``, tested against the published math in test_quant_codecs.py); the positions past
its last whole page must read back exactly (the full-precision residual), however the writes arrived:
token by token (decode), in prefill chunks that end mid-page, or both.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.contract import KVGeometry
from sgl_sparse.errors import SparseConfigError
from sgl_sparse.kernels import quant
from sgl_sparse.registry import create_method
from sgl_sparse.store_reads import attend

HKV, G, D, GS, LAYERS, PAGES, ROWS = 2, 2, 16, 8, 2, 40, 4
SCALE = 1 / math.sqrt(D)


def _geometry(dtype: torch.dtype = torch.float32) -> KVGeometry:
    return KVGeometry(num_layers=LAYERS, num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, page_size=GS,
                      num_slots=PAGES * GS, dtype=dtype, device=torch.device("cpu"), max_requests=ROWS)


def _store(bits: int):
    store = create_method("kivi", {"bits": bits, "group_size": GS}).store
    store.allocate(_geometry())
    return store


def _expected(k: torch.Tensor, v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a row of ``n`` positions must read back: KIVI of each whole page, the open page exactly."""
    whole = k.shape[0] // GS * GS

    def half(t: torch.Tensor) -> torch.Tensor:  # KIVI keeps scales and zero points in fp16
        return t.half().float()

    kc, ks, kz = quant.kivi_keys(k[:whole], bits, GS)
    vc, vs, vz = quant.kivi_values(v[:whole], bits, GS)
    kq = quant.kivi_keys_dequantize(kc, half(ks), half(kz), torch.float32)
    vq = quant.kivi_values_dequantize(vc, half(vs), half(vz), torch.float32)
    return torch.cat([kq, k[whole:]]), torch.cat([vq, v[whole:]])


def _row_slots(row: int, n: int) -> torch.Tensor:
    """Row ``row``'s positions on pages of its own (page-aligned, as SGLang's paged allocator gives)."""
    pages = torch.arange(1 + row * 8, 1 + row * 8 + -(-n // GS))
    pos = torch.arange(n)
    return pages[pos // GS] * GS + pos % GS


def test_config_and_sizes() -> None:
    with pytest.raises(SparseConfigError, match="bits"):
        create_method("kivi", {"bits": 3})
    g = _geometry(torch.bfloat16)
    for bits in (2, 4):
        store = create_method("kivi", {"bits": bits, "group_size": GS}).store
        assert store.page_size == GS
        per_layer = 2 * HKV * D * bits // 8 + 2 * HKV * D * 2 // GS + 2 * HKV * (D // GS) * 2
        assert store.bytes_per_token(g) == LAYERS * per_layer
        store.allocate(g)
        taken = sum(t.numel() * t.element_size() for name in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale",
                                                               "v_zero") for t in getattr(store, name))
        assert taken == store.bytes_per_token(g) * g.num_slots
        res = sum(t.numel() * t.element_size() for t in store.res_k + store.res_v)
        assert res == store.fixed_bytes(g) == LAYERS * 2 * ROWS * GS * HKV * D * 2


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("chunks", [[37], [5, 3, 29], [8, 8, 21], [1] * 37, [12, 1, 1, 1, 22]])
def test_any_write_pattern_reads_back_kivi_pages_and_an_exact_residual(bits: int, chunks: list[int]) -> None:
    """Two rows written side by side: prefill chunks (several pages in one write, chunks ending mid-page), or
    one token per row at a time as decode writes them."""
    store = _store(bits)
    gen = torch.Generator().manual_seed(bits * 100 + len(chunks))
    n = sum(chunks)
    rows = [1, 3]
    kk = {r: torch.randn(n, HKV, D, generator=gen) * torch.linspace(0.1, 4, D) for r in rows}  # channel outliers
    vv = {r: torch.randn(n, HKV, D, generator=gen) for r in rows}
    slots = {r: _row_slots(r, n) for r in rows}
    at = 0
    for c in chunks:
        for r in rows:
            sl = slice(at, at + c)
            store.write(1, slots[r][sl], kk[r][sl], vv[r][sl], torch.full((c,), r), decode=False)
        at += c
    r2t = torch.zeros(ROWS, 64, dtype=torch.int32)
    for r in rows:
        r2t[r, :n] = slots[r].to(torch.int32)
        got_k, got_v = store._row(1, r2t, r, n)
        want_k, want_v = _expected(kk[r], vv[r], bits)
        torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=1e-5)
        whole = n // GS * GS
        assert torch.equal(got_k[whole:], kk[r][whole:])  # the residual is exact
    q = torch.randn(2, HKV * G, D, generator=gen)
    out = store.decode(1, q, r2t, torch.tensor(rows), torch.tensor([n, n]), SCALE)
    for i, r in enumerate(rows):
        want = attend(q[i:i + 1], *_expected(kk[r], vv[r], bits), SCALE)[0][0]
        torch.testing.assert_close(out[i], want, atol=1e-5, rtol=1e-4)


def test_an_extend_write_does_not_depend_on_the_order_of_its_tokens() -> None:
    """Two rows' chunks in one write, tokens shuffled: every page the chunk fills is quantized, whatever token
    of it comes last. (CUDA's scatter with duplicate indices keeps an unspecified one: a page whose last
    offset did not win counted as open, was never quantized, and read back as zeros on the GPU.)"""
    gen = torch.Generator().manual_seed(11)
    n, rows = 45, [1, 2]
    k = torch.randn(2 * n, HKV, D, generator=gen) * torch.linspace(0.1, 4, D)
    v = torch.randn(2 * n, HKV, D, generator=gen)
    slots = torch.cat([_row_slots(r, n) for r in rows])
    row_of = torch.repeat_interleave(torch.tensor(rows), n)
    a, b = _store(4), _store(4)
    a.write(0, slots, k, v, row_of, decode=False)
    perm = torch.randperm(2 * n, generator=gen)
    b.write(0, slots[perm], k[perm], v[perm], row_of[perm], decode=False)
    r2t = torch.zeros(ROWS, 64, dtype=torch.int32)
    for i, r in enumerate(rows):
        r2t[r, :n] = slots[i * n:(i + 1) * n].to(torch.int32)
        want_k, want_v = _expected(k[i * n:(i + 1) * n], v[i * n:(i + 1) * n], 4)
        for store in (a, b):
            got_k, got_v = store._row(0, r2t, r, n)
            torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=1e-5)


def test_decode_writes_one_token_per_row_in_one_call() -> None:
    """The decode form (``decode=True``: one token per row, no host sync) gives what extend writes give."""
    a, b = _store(4), _store(4)
    gen = torch.Generator().manual_seed(7)
    rows = torch.tensor([0, 2, 3])
    n = 19
    k = torch.randn(3, n, HKV, D, generator=gen)
    v = torch.randn(3, n, HKV, D, generator=gen)
    slots = torch.stack([_row_slots(int(r), n) for r in rows])
    for t in range(n):
        a.write(0, slots[:, t], k[:, t], v[:, t], rows, decode=True)
    for i, r in enumerate(rows.tolist()):
        b.write(0, slots[i], k[i], v[i], torch.full((n,), r), decode=False)
    r2t = torch.zeros(ROWS, 64, dtype=torch.int32)
    for i, r in enumerate(rows.tolist()):
        r2t[r, :n] = slots[i].to(torch.int32)
        for x, y in zip(a._row(0, r2t, r, n), b._row(0, r2t, r, n), strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("bits", [2, 4])
def test_decode_write_kernel_equals_the_torch_write(bits: int) -> None:
    """kernels/kivi_write.py (one program per row and KV head; only a row whose token fills its page quantizes)
    leaves every buffer as the torch decode write does, codes, scales and zero points bit for bit, over steps that
    fill pages of some rows and not others, and rows that start mid-page (run interpreted on CPU)."""
    if not INTERPRETED:
        pytest.skip("the kernel runs in the interpreted run")
    from sgl_sparse.kernels import kivi_write

    a, b = _store(bits), _store(bits)
    gen = torch.Generator().manual_seed(11 + bits)
    rows = torch.tensor([3, 0, 2])
    start = torch.tensor([0, 5, GS - 2])  # row 2's first step fills its first page's last but one slot
    n = 2 * GS + 3
    k = torch.randn(3, n, HKV, D, generator=gen) * torch.linspace(0.1, 4, D)
    v = torch.randn(3, n, HKV, D, generator=gen)
    v[0, :GS, 1] = 0.5  # a constant page (scale 0) and ties in the rounding
    slots = torch.stack([_row_slots(int(r), int(s) + n)[int(s):] for r, s in zip(rows, start, strict=True)])
    for t in range(n):
        a.write(0, slots[:, t], k[:, t], v[:, t], rows, decode=True)
        kivi_write.decode_write(b._buffers(0), slots[:, t], k[:, t], v[:, t], rows, bits, GS)
    # Page 0 is SGLang's padding page, where the torch write stores the rows that filled nothing; no row reads it.
    for name, x, y in zip(["k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "res_k", "res_v"],
                          a._buffers(0), b._buffers(0), strict=True):
        skip = 0 if name.startswith("res") else 1 if name in ("k_scale", "k_zero") else GS
        assert torch.equal(x[skip:], y[skip:]), (name, (x[skip:] != y[skip:]).nonzero()[:5])


def test_prefix_reads_whole_pages_and_the_residual() -> None:
    store = _store(4)
    gen = torch.Generator().manual_seed(9)
    n = 21  # 2 whole pages + 5 in the residual
    k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    slots = _row_slots(2, n)
    store.write(0, slots, k, v, torch.full((n,), 2), decode=False)
    r2t = torch.zeros(ROWS, 64, dtype=torch.int32)
    r2t[2, :n] = slots.to(torch.int32)
    q = torch.randn(6, HKV * G, D, generator=gen)
    o, lse = store.prefix(0, q, torch.tensor([0, 4, 6]), r2t, torch.tensor([2, 1]), torch.tensor([n, 0]), [4, 2],
                          SCALE)
    want_o, want_lse = attend(q[:4], *_expected(k, v, 4), SCALE)
    torch.testing.assert_close(o[:4], want_o, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse[:4], want_lse, atol=1e-3, rtol=1e-3)
    assert torch.isinf(lse[4:]).all()


@pytest.mark.parametrize("key_rows", [False, True])
@pytest.mark.parametrize("bits", [2, 4])
def test_decode_kernel_equals_the_store_reference(bits: int, key_rows: bool) -> None:
    """The Triton decode (kernels/kivi_attention.py) over rows with whole pages and a residual, an empty row
    and a row inside its first page, against the store's torch path (run interpreted on CPU)."""
    if not INTERPRETED:
        pytest.skip("the kernel runs in the interpreted run")
    from sgl_sparse.kernels import kivi_attention

    store = _store(bits)
    gen = torch.Generator().manual_seed(bits)
    lens = {0: 27, 1: 5, 2: 0, 3: 40}
    r2t = torch.zeros(ROWS, 64, dtype=torch.int32)
    for r, n in lens.items():
        if n:
            slots = _row_slots(r, n)
            k = torch.randn(n, HKV, D, generator=gen) * torch.linspace(0.1, 4, D)
            store.write(1, slots, k, torch.randn(n, HKV, D, generator=gen), torch.full((n,), r), decode=False)
            r2t[r, :n] = slots.to(torch.int32)
    rpi = torch.tensor(list(lens), dtype=torch.int32)
    seq = torch.tensor(list(lens.values()), dtype=torch.int32)
    q = torch.randn(len(lens), HKV * G, D, generator=gen)
    want = store.decode(1, q, r2t, rpi.long(), seq.long(), SCALE)
    got = kivi_attention.decode_attention(q, *store._buffers(1), r2t, rpi, seq, SCALE, bits, GS, splits=3,
                                          key_rows=key_rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [2, 4])
def test_prefix_kernel_equals_the_store_reference(bits: int) -> None:
    """The Triton extend over the cached prefix (whole pages + residual; an empty prefix; a prefix inside its
    first page) against the store's torch path (run interpreted on CPU)."""
    if not INTERPRETED:
        pytest.skip("the kernel runs in the interpreted run")
    from sgl_sparse.kernels import fp8_attention, kivi_attention
    from sgl_sparse.kernels.splits import prefix_passes

    store = _store(bits)
    gen = torch.Generator().manual_seed(10 + bits)
    prefix = {0: 27, 1: 5, 2: 0, 3: 40}
    new = [3, 7, 2, 1]
    r2t = torch.zeros(ROWS, 64, dtype=torch.int32)
    for r, n in prefix.items():
        if n:
            slots = _row_slots(r, n)
            store.write(1, slots, torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen),
                        torch.full((n,), r), decode=False)
            r2t[r, :n] = slots.to(torch.int32)
    rpi = torch.tensor(list(prefix), dtype=torch.int32)
    lens = torch.tensor(list(prefix.values()), dtype=torch.int32)
    qo = torch.tensor([0, 3, 10, 12, 13], dtype=torch.int32)
    q = torch.randn(13, HKV * G, D, generator=gen)
    want, want_lse = store.prefix(1, q, qo, r2t, rpi.long(), lens.long(), new, SCALE)
    bm = fp8_attention.prefix_block_m(G, False, 4)
    # One workspace pass with the step's blocks, and passes of at most 30 prefix tokens (27 | 5 | 40 alone).
    for kw in ({"blocks": fp8_attention.prefix_blocks(new, bm, q.device)}, {"ws_tokens": 30}):
        got, got_lse = kivi_attention.prefix_attention(q, *store._buffers(1), qo, r2t, rpi, lens, SCALE, bits, GS,
                                                       new, bm, block_n=16, **kw)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)
    assert prefix_passes([27, 5, 0, 40], 30) == [[0], [1], [3]]
    assert prefix_passes([27, 5, 0, 40], 80) == [[0, 1, 3]]


@pytest.mark.parametrize("bits", [2, 4])
def test_read_prefix_is_whole_pages_and_the_residual_flat(bits: int) -> None:
    """``prefix_attention: dequantize``: the step's prefixes (whole pages + residual, one inside its first page),
    rows in batch order, flat; the same through the Triton workspace kernel (interpreted run)."""
    from sgl_sparse.integration.store_attention import StoreRows, dense_prefix

    store = create_method("kivi", {"bits": bits, "group_size": GS, "prefix_attention": "dequantize"}).store
    assert store.dequantize_prefix and store.describe()["prefix_attention"] == "dequantize"
    store.allocate(_geometry())
    gen = torch.Generator().manual_seed(20 + bits)
    prefix = {3: 40, 2: 0, 0: 27, 1: 5}  # row 2: a request of the step without a prefix reads nothing
    r2t = torch.zeros(ROWS, 64, dtype=torch.int32)
    want_k, want_v = [], []
    for r, n in prefix.items():
        if n == 0:
            continue
        slots = _row_slots(r, n)
        k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
        store.write(1, slots, k, v, torch.full((n,), r), decode=False)
        r2t[r, :n] = slots.to(torch.int32)
        ek, ev = _expected(k, v, bits) if n >= GS else (k, v)  # inside its first page: the residual alone
        want_k.append(ek)
        want_v.append(ev)
    rpi, lens = torch.tensor(list(prefix)), list(prefix.values())
    dense = dense_prefix(StoreRows(r2t, rpi, torch.tensor(lens)), lens)
    got_k, got_v = store.read_prefix(1, r2t, rpi, torch.tensor(lens, dtype=torch.int32), lens, dense.slots)
    torch.testing.assert_close(got_k, torch.cat(want_k), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v, torch.cat(want_v), atol=1e-5, rtol=1e-5)
    if INTERPRETED:
        store.use_triton = True
        tk, tv = store.read_prefix(1, r2t, rpi.to(torch.int32), torch.tensor(lens, dtype=torch.int32), lens,
                                   dense.slots)
        torch.testing.assert_close(tk, got_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tv, got_v, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_triton_kernel_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
