"""DeltaKV's layout (sgl_sparse/methods/compression/deltakv_store.py) against DeltaKV written out here in plain
torch: a sequence written into the pool in prefill chunks and decode steps, by two requests that share a prefix
through their rows, reads back as the reference compresses the whole sequence at once."""

from __future__ import annotations

import pytest
import torch

from sgl_sparse.contract import AttentionProjections, KVGeometry, ModelKV, RotaryTable
from sgl_sparse.kernels.rope import rotate
from sgl_sparse.methods.compression.deltakv_compressor import Compressor, CompressorConfig
from sgl_sparse.methods.compression.deltakv_store import DeltaKVStore

HKV, D, LAYERS, STRIDE, K = 2, 8, 3, 5, 3
SPARSE = (1, 2)


def _table(n: int) -> torch.Tensor:
    inv = 1.0 / 10_000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1).float()


def _store(dtype: torch.dtype = torch.float32, latent_bits: int = 16, keep: int = 0, sink: int = 0,
           recent: int = 0, sparse: tuple[int, ...] = SPARSE) -> tuple[DeltaKVStore, RotaryTable]:
    """latent 6 in the model dtype, or 32 (one group) at 4 bits; ``keep``/``sink``/``recent``: decode's selection."""
    torch.manual_seed(0)
    comp = Compressor(CompressorConfig(kv_dim=2 * HKV * D, latent_dim=6 if latent_bits == 16 else 32,
                                       intermediate=16, layers=sparse, stride=STRIDE, neighbors=K))
    store = DeltaKVStore(comp.config, lambda: comp, latent_bits=latent_bits, keep_tokens=keep, sink_tokens=sink,
                         recent_tokens=recent)
    rot = RotaryTable(_table(256), D, True)
    proj = AttentionProjections(torch.zeros(HKV * D, 4), torch.zeros(HKV * D, 4))
    store.load_model(ModelKV((proj,) * LAYERS, HKV, D, D, rot))
    store.allocate(KVGeometry(LAYERS, 2 * HKV, HKV, D, STRIDE, 40 * STRIDE, dtype, torch.device("cpu")))
    return store, rot


def _int4(z: torch.Tensor) -> torch.Tensor:
    """A latent as 4-bit codes keep it: per 32 values, 15 steps from the min to the max, scale and zero in fp16."""
    out = torch.empty_like(z)
    for i in range(0, z.shape[-1], 32):
        g = z[..., i:i + 32]
        zero = g.min().half().float()
        scale = ((g.max() - g.min()) / 15).half().float()
        codes = torch.round((g - zero) / scale if scale > 0 else g * 0).clamp(0, 15)
        out[..., i:i + 32] = codes * scale + zero
    return out


def _reference(comp: Compressor, layer: int, k: torch.Tensor, v: torch.Tensor, rot: RotaryTable,
               dtype: torch.dtype, latent_bits: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """DeltaKV over a whole sequence, one token at a time: K un-rotated, kv = [K, V]; every STRIDE-th token kept;
    every other one as up(z) + c, z = down(kv) - down(c) as stored (the model dtype or 4-bit codes), c the mean of
    its K nearest earlier centres (L2, ties to the earlier centre); K rotated back."""
    n = k.shape[0]
    pos = torch.arange(n)
    pre = rotate(k, rot.cos_sin[pos], D, True, inverse=True)
    kv = torch.cat([pre.reshape(n, -1), v.float().reshape(n, -1)], dim=1).to(dtype).float()
    out = kv.clone()
    for t in range(n):
        if t % STRIDE == 0:
            continue
        cands = list(range(0, t, STRIDE))
        dist = sorted((float(torch.dist(kv[t], kv[c])), c) for c in cands)
        chosen = [c for _, c in dist[:K]]
        c = kv[chosen].mean(0, keepdim=True)
        with torch.no_grad():
            z = comp.down[str(layer)](kv[t:t + 1]) - comp.down[str(layer)](c)
            z = _int4(z) if latent_bits == 4 else z.to(dtype).float()
            out[t] = (comp.up[str(layer)](z) + c)[0]
    half = HKV * D
    kr = rotate(out[:, :half].reshape(n, HKV, D), rot.cos_sin[pos], D, True).to(dtype)
    return kr, out[:, half:].reshape(n, HKV, D).to(dtype)


def _write(store: DeltaKVStore, layer: int, r2t: torch.Tensor, row: int, k: torch.Tensor, v: torch.Tensor,
           start: int, end: int) -> None:
    loc = r2t[row, start:end].long()
    store.write(layer, loc, k[start:end], v[start:end], torch.full((end - start,), row), decode=end - start == 1,
                positions=torch.arange(start, end))


@pytest.mark.parametrize(("dtype", "latent_bits"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 4),
                                                   (torch.bfloat16, 4)])
def test_chunked_writes_by_two_requests_sharing_a_prefix_read_back_as_the_whole_sequence(dtype: torch.dtype,
                                                                                      latent_bits: int) -> None:
    store, rot = _store(dtype, latent_bits)
    g = torch.Generator().manual_seed(1)
    n_a, shared, n_b = 43, 30, 52  # B matches A's first 30 positions (6 whole pages) and goes on
    k = torch.randn(n_b, HKV, D, generator=g)
    v = torch.randn(n_b, HKV, D, generator=g)
    k_a, v_a = k[:n_a].clone(), v[:n_a].clone()
    k_a[shared:], v_a[shared:] = torch.randn(n_a - shared, HKV, D, generator=g), torch.randn(n_a - shared, HKV, D,
                                                                                            generator=g)
    store.attach_rows(r2t := torch.zeros(3, 64, dtype=torch.int32))
    # pages of STRIDE slots: A's rows on pages 1-9, B shares A's first 6 pages and continues on pages 20+
    r2t[1, :50] = torch.arange(STRIDE, STRIDE + 50, dtype=torch.int32)
    r2t[2, :shared] = r2t[1, :shared]
    r2t[2, shared:60] = torch.arange(20 * STRIDE, 20 * STRIDE + 60 - shared, dtype=torch.int32)
    for layer in range(LAYERS):
        for start, end in [(0, 17), (17, 40), *((i, i + 1) for i in range(40, n_a))]:  # chunks, then decode
            _write(store, layer, r2t, 1, k_a, v_a, start, end)
        for start, end in [(shared, shared + 9), *((i, i + 1) for i in range(shared + 9, n_b))]:
            _write(store, layer, r2t, 2, k, v, start, end)
    for layer in range(LAYERS):
        for row, (kk, vv) in ((1, (k_a, v_a)), (2, (k, v))):
            n = kk.shape[0]
            got_k, got_v = store.read(layer, r2t[row, :n].long())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            if layer in SPARSE:
                want_k, want_v = _reference(store.compressor, layer, kk, vv, rot, dtype, latent_bits)
                # round_trip is what the pool reads, up to the latent's rounding: the MLPs' fp32 sums depend on how
                # many tokens one call encodes, and a one-ulp flip of a bf16 latent moves the token by ~1e-2
                rt_k, rt_v = store.round_trip(layer, kk, vv, torch.arange(n))
                torch.testing.assert_close(rt_k.float(), got_k.float(), atol=tol, rtol=tol)
                torch.testing.assert_close(rt_v.float(), got_v.float(), atol=tol, rtol=tol)
            else:
                want_k, want_v = kk.to(dtype), vv.to(dtype)
            torch.testing.assert_close(got_k.float(), want_k.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(got_v.float(), want_v.float(), atol=tol, rtol=tol)
    # a compressed token differs from its raw K/V (the layout is lossy), a centre does not
    raw_v = v_a[1:STRIDE].to(dtype)
    assert not torch.allclose(store.read(1, r2t[1, 1:STRIDE].long())[1].float(), raw_v.float(), atol=1e-3)
    torch.testing.assert_close(store.read(1, r2t[1, :1].long())[1], v_a[:1].to(dtype))


def test_bytes_per_token_and_launch_time_errors() -> None:
    store, _ = _store(torch.bfloat16)
    comp = store.compressor
    assert comp is not None
    for mode, dequantize in (("dequantize", True), ("kernel", False)):  # the config's prefix read, not a default
        chosen = DeltaKVStore(comp.config, lambda: comp, prefix_attention=mode)
        assert (chosen.prefix_attention, chosen.dequantize_prefix) == (mode, dequantize)
    g = KVGeometry(LAYERS, 2 * HKV, HKV, D, STRIDE, 10, torch.bfloat16, torch.device("cpu"))
    full = 2 * HKV * D * 2
    sparse = 6 * 2 + (K + 1) * 4 + -(-(2 * HKV * D * 2) // STRIDE)
    assert store.bytes_per_token(g) == full + 2 * sparse
    with pytest.raises(ValueError, match="page size"):
        store.allocate(KVGeometry(LAYERS, 2 * HKV, HKV, D, 1, 10, torch.bfloat16, torch.device("cpu")))
    proj = AttentionProjections(torch.zeros(4 * D, 4), torch.zeros(4 * D, 4))
    with pytest.raises(ValueError, match="kv 32 wide"):
        store.load_model(ModelKV((proj,) * LAYERS, 4, D, D, None))
    with pytest.raises(ValueError, match=r"layers \[1, 2\], the model 1"):
        store.load_model(ModelKV((proj,), HKV, D, D, None))
    # 4-bit latents: 16 bytes of codes and a scale and zero point (fp16) for the one group of 32
    store4, _ = _store(torch.bfloat16, latent_bits=4)
    assert store4.bytes_per_token(g) == full + 2 * (16 + 4 + (K + 1) * 4 + -(-(2 * HKV * D * 2) // STRIDE))
    with pytest.raises(ValueError, match="latent_bits 4 over a latent of 6"):
        DeltaKVStore(store.config, lambda: store.compressor, latent_bits=4)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="latent_bits 8"):
        DeltaKVStore(store4.config, lambda: store4.compressor, latent_bits=8)  # type: ignore[arg-type,return-value]


def _attend_at(store: DeltaKVStore, layer: int, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention of ``q`` ``[Hq, D]`` over the tokens at ``slots`` as the pool reads them back."""
    k, v = store.read(layer, slots)
    k = k.float().repeat_interleave(q.shape[0] // HKV, dim=1)  # [n, Hq, D]
    v = v.float().repeat_interleave(q.shape[0] // HKV, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * D ** -0.5, dim=1)
    return torch.einsum("hn,nhd->hd", p, v)


def _filled(keep: int, sink: int, recent: int, sparse: tuple[int, ...] = SPARSE, lens: tuple[int, ...] = (43, 61),
            ) -> tuple[DeltaKVStore, torch.Tensor, torch.Tensor]:
    store, _ = _store(keep=keep, sink=sink, recent=recent, sparse=sparse)
    g = torch.Generator().manual_seed(3)
    store.attach_rows(r2t := torch.zeros(len(lens) + 1, 64, dtype=torch.int32))
    for row, n in enumerate(lens, start=1):
        r2t[row, :n] = torch.arange(row * 10 * STRIDE, row * 10 * STRIDE + n, dtype=torch.int32)
        k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
        for layer in range(LAYERS):
            _write(store, layer, r2t, row, k, v, 0, n)
    return store, r2t, torch.randn(len(lens), 2 * HKV, D, generator=g)


@pytest.mark.parametrize(("keep", "sink", "recent"), [(10, 2, 5), (1, 3, 4), (20, 0, 0)])
def test_decode_reads_on_sparse_layers_what_the_full_layer_before_them_selected(keep: int, sink: int,
                                                                                recent: int) -> None:
    """The original's decode: the full layer 0 scores every token with this step's queries (the largest q . k over
    the query heads, its raw keys), its ``keep`` best beside the first ``sink`` and last ``recent`` positions are
    what sparse layers 1 and 2 read (here against that selection made in plain torch); a row no longer than the
    selection reads every token, as a store without one does."""
    lens = (43, 61)
    store, r2t, q = _filled(keep, sink, recent, lens=lens)
    rows, seq = torch.tensor([1, 2]), torch.tensor(lens)
    everything, _, _ = _filled(0, 0, 0, lens=lens)
    full = everything.decode(0, q, r2t, rows, seq, D ** -0.5)
    torch.testing.assert_close(store.decode(0, q, r2t, rows, seq, D ** -0.5), full)  # a full layer reads everything
    for layer in SPARSE:
        got = store.decode(layer, q, r2t, rows, seq, D ** -0.5)
        for i, n in enumerate(lens):
            slots = r2t[i + 1, :n].long()
            keys = store.k[0][slots].float()  # [n, Hkv, D]
            score = torch.einsum("hgd,nhd->nhg", q[i].view(HKV, 2, D), keys).amax(dim=(1, 2))
            score[:sink] = float("inf")
            score[n - recent:] = float("inf")
            chosen = torch.topk(score, min(n, sink + keep + recent)).indices.sort().values
            assert len(chosen) < n  # every row here is longer than its selection
            torch.testing.assert_close(got[i], _attend_at(store, layer, q[i], slots[chosen]), atol=1e-5, rtol=1e-5)
            assert not torch.allclose(got[i], _attend_at(store, layer, q[i], slots), atol=1e-3)


def test_decode_reads_every_token_where_the_selection_covers_the_row_or_no_full_layer_precedes() -> None:
    lens = (43, 61)
    rows, seq = torch.tensor([1, 2]), torch.tensor(lens)
    everything, r2t, q = _filled(0, 0, 0, lens=lens)
    covering, _, _ = _filled(50, 8, 8, lens=lens)  # 66 >= 61
    for layer in range(LAYERS):
        torch.testing.assert_close(covering.decode(layer, q, r2t, rows, seq, D ** -0.5),
                                   everything.decode(layer, q, r2t, rows, seq, D ** -0.5))
    # layer 0 sparse, layer 1 full: layer 0 reads every token, layer 2 the selection
    first_sparse, _, _ = _filled(5, 1, 1, sparse=(0, 2), lens=lens)
    every, _, _ = _filled(0, 0, 0, sparse=(0, 2), lens=lens)
    outs = [first_sparse.decode(layer, q, r2t, rows, seq, D ** -0.5) for layer in range(LAYERS)]
    torch.testing.assert_close(outs[0], every.decode(0, q, r2t, rows, seq, D ** -0.5))
    assert not torch.allclose(outs[2], every.decode(2, q, r2t, rows, seq, D ** -0.5), atol=1e-3)

