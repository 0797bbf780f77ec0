"""Palu's store against plain-torch references written here: the rotary helper against SGLang's own rotary
classes, the store's reconstruction against Palu's factorization (``W ~= B A``, cache ``A x``, read ``B A x``)
computed from the hidden states, attention over the store against attention over that reconstruction."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse import SparseConfigError, create_method
from sgl_sparse.contract import AttentionProjections, KVGeometry, ModelKV, RotaryTable
from sgl_sparse.kernels.rope import rotate
from sgl_sparse.methods.compression.palu import PaluStore, group_rank

HKV, HQ, D, HIDDEN, LAYERS = 4, 8, 32, 160, 2


def _table(max_pos: int, rotary_dim: int, base: float = 10_000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1).float()


def _rope_ref(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, neox: bool, base: float = 10_000.0) -> torch.Tensor:
    """Rotary embedding from its definition: pair j of a head rotated by ``pos * base^(-2j / rotary_dim)``."""
    out = x.double().clone()
    for j in range(rotary_dim // 2):
        a, b = (j, j + rotary_dim // 2) if neox else (2 * j, 2 * j + 1)
        ang = pos.double()[:, None] * base ** (-2 * j / rotary_dim)
        xa, xb = x[..., a].double(), x[..., b].double()
        out[..., a] = xa * ang.cos() - xb * ang.sin()
        out[..., b] = xb * ang.cos() + xa * ang.sin()
    return out


@pytest.mark.parametrize(("neox", "rotary_dim"), [(True, D), (False, D), (True, D // 2)])
def test_rotate_is_the_rotary_embedding_and_inverse_undoes_it(neox: bool, rotary_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, HKV, D, generator=gen)
    pos = torch.randint(0, 4000, (50,), generator=gen)
    cs = _table(4096, rotary_dim)[pos]
    y = rotate(x, cs, rotary_dim, neox)
    torch.testing.assert_close(y.double(), _rope_ref(x, pos, rotary_dim, neox), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rotate(y, cs, rotary_dim, neox, inverse=True), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls_name", ["RotaryEmbedding", "Llama3RotaryEmbedding"])
def test_rotate_matches_sglangs_rotary_classes(cls_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table the integration hands over (SGLang's ``cos_sin_cache``) rotates K as SGLang's own module does."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from sglang.srt.layers.rotary_embedding import base, get_rope

    # Outside a server SGLang's runtime context is unset; its rotary classes read one setting of it.
    exec_ns = SimpleNamespace(deterministic=SimpleNamespace(rl_on_policy_target=None))
    monkeypatch.setattr(base, "get_exec", lambda: exec_ns)
    monkeypatch.setattr(base, "_is_cpu", True)  # as in a --device cpu server: the torch forward, no custom op

    scaling = None
    if cls_name == "Llama3RotaryEmbedding":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 512}
    rope = get_rope(D, rotary_dim=D, max_position=4096, base=500_000, is_neox_style=True, rope_scaling=scaling,
                    dtype=torch.float32)
    assert type(rope).__name__ == cls_name
    gen = torch.Generator().manual_seed(1)
    pos = torch.randint(0, 4096, (20,), generator=gen)
    q, k = torch.randn(20, HQ * D, generator=gen), torch.randn(20, HKV * D, generator=gen)
    _, k_sgl = rope.forward_native(pos, q.clone(), k.clone())
    table = rope.cos_sin_cache.float()
    got = rotate(k.view(20, HKV, D), table[pos], D, True)
    torch.testing.assert_close(got.reshape(20, -1), k_sgl.float(), rtol=1e-4, atol=1e-4)


def _model(group_size: int, seed: int = 2, rotary_dim: int = D) -> tuple[ModelKV, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    layers, weights = [], []
    for _ in range(LAYERS):
        wk = torch.randn(HKV * D, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
        wv = torch.randn(HKV * D, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
        layers.append(AttentionProjections(wk, wv))
        weights.append(torch.stack([wk, wv]))
    return ModelKV(tuple(layers), HKV, D, D, RotaryTable(_table(4096, rotary_dim), rotary_dim, True)), weights


def _store(ratio: float, group_size: int, dtype: torch.dtype = torch.float32, slots: int = 256,
           rotary_dim: int = D) -> tuple[PaluStore, list[torch.Tensor]]:
    store = PaluStore(ratio, group_size)
    model, weights = _model(group_size, rotary_dim=rotary_dim)
    store.load_model(model)
    store.allocate(KVGeometry(LAYERS, HQ, HKV, D, 1, slots, dtype, torch.device("cpu")))
    return store, weights


def _palu_reference(w: torch.Tensor, x: torch.Tensor, group_size: int, rank: int) -> torch.Tensor:
    """Palu's factorization per group of heads, from its definition: ``W_g = U S V^T``, ``B = U_r S_r``,
    ``A = V_r^T``; the cache holds ``A x`` and attention reads ``B (A x)`` -> ``[n, Hkv, D]`` (pre-rotary)."""
    out = []
    for g in range(HKV // group_size):
        wg = w[g * group_size * D:(g + 1) * group_size * D].double()
        u, s, vh = torch.linalg.svd(wg, full_matrices=False)
        b, a = u[:, :rank] * s[:rank], vh[:rank]
        out.append((x.double() @ a.T) @ b.T)
    return torch.cat(out, dim=-1).view(x.shape[0], HKV, D)


@pytest.mark.parametrize(("ratio", "group_size"), [(0.5, 1), (0.25, 2), (0.75, 4)])
def test_read_is_palus_reconstruction_at_the_tokens_position(ratio: float, group_size: int) -> None:
    store, weights = _store(ratio, group_size)
    rank = group_rank(group_size * D, ratio)
    gen = torch.Generator().manual_seed(3)
    n = 40
    x = torch.randn(n, HIDDEN, generator=gen)
    pos = torch.randint(0, 4000, (n,), generator=gen)
    loc = torch.randperm(200, generator=gen)[:n] + 1
    layer = 1
    wk, wv = weights[layer]
    k = _rope_ref((x @ wk.T).view(n, HKV, D), pos, D, True).float()  # what the model hands the pool: post-RoPE
    v = (x @ wv.T).view(n, HKV, D)
    store.write(layer, loc, k, v, torch.zeros(n, dtype=torch.int64), decode=False, positions=pos)
    got_k, got_v = store.read(layer, loc)
    want_k = _rope_ref(_palu_reference(wk, x, group_size, rank), pos, D, True)
    want_v = _palu_reference(wv, x, group_size, rank)
    torch.testing.assert_close(got_k.double(), want_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_v.double(), want_v, rtol=1e-4, atol=1e-4)
    assert (got_k - k).abs().max() > 1e-2  # a rank below the group's loses something
    rk, rv = store.round_trip(layer, k, v, pos)
    torch.testing.assert_close(rk, got_k) and torch.testing.assert_close(rv, got_v)
    assert store.read(0, loc)[0].abs().sum() == 0  # other layers untouched


def test_full_rank_reads_back_what_was_written() -> None:
    """At a rank covering the group (rank_ratio 1) the projection is the identity: the layout loses nothing but
    rounding, a partial rotary dimension included."""
    store, _ = _store(1.0, 1, rotary_dim=D // 2)
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(30, HKV, D, generator=gen), torch.randn(30, HKV, D, generator=gen)
    pos = torch.arange(1000, 1030)
    loc = torch.arange(5, 35)
    store.write(0, loc, k, v, torch.zeros(30, dtype=torch.int64), decode=True, positions=pos)
    got_k, got_v = store.read(0, loc)
    torch.testing.assert_close(got_k, k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_v, v, rtol=1e-4, atol=1e-4)


def test_decode_attends_over_the_reconstruction() -> None:
    """The store's decode (the torch path the CPU server runs) equals softmax attention over the reference
    reconstruction of each row's tokens."""
    store, weights = _store(0.5, 2, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    lens = [17, 40]
    table = torch.zeros(3, 64, dtype=torch.int64)
    x_rows = []
    for r, n in enumerate(lens, start=1):
        x = torch.randn(n, HIDDEN, generator=gen)
        pos = torch.arange(n)
        table[r, :n] = torch.arange(n) + 64 * r
        k = _rope_ref((x @ weights[0][0].T).view(n, HKV, D), pos, D, True).to(torch.bfloat16)
        v = (x @ weights[0][1].T).view(n, HKV, D).to(torch.bfloat16)
        store.write(0, table[r, :n], k, v, torch.full((n,), r), decode=False, positions=pos)
        x_rows.append(x)
    q = torch.randn(2, HQ, D, generator=gen).to(torch.bfloat16)
    scale = D ** -0.5
    got = store.decode(0, q, table, torch.tensor([1, 2]), torch.tensor(lens), scale)
    rank = group_rank(2 * D, 0.5)
    for i, (x, n) in enumerate(zip(x_rows, lens, strict=True)):
        # the latents are stored in bf16: the reference rounds them as the pool does
        kr = _rope_ref(_palu_reference(weights[0][0], x, 2, rank), torch.arange(n), D, True)
        vr = _palu_reference(weights[0][1], x, 2, rank)
        kh = kr.repeat_interleave(HQ // HKV, dim=1)
        vh = vr.repeat_interleave(HQ // HKV, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), kh) * scale, dim=-1)
        want = torch.einsum("hn,nhd->hd", p, vh)
        torch.testing.assert_close(got[i].double(), want, rtol=0.05, atol=0.05)


def test_bytes_per_token_and_ranks() -> None:
    assert group_rank(128, 0.5) == 64 and group_rank(128, 0.75) == 96 and group_rank(64, 0.1) == 16
    assert group_rank(16, 0.5) == 16  # the floor of 16, capped at the group
    store = PaluStore(0.5, 1)
    g = KVGeometry(32, 32, 8, 128, 1, 0, torch.bfloat16, torch.device("cpu"))
    assert store.bytes_per_token(g) == 32 * (8 * (64 + 64) * 2 + 4)  # 2,052 bytes a layer against bf16's 4,096


def test_bad_configs_and_models_are_refused() -> None:
    with pytest.raises(SparseConfigError, match="rank_ratio"):
        create_method("palu", {"rank_ratio": 0})
    with pytest.raises(SparseConfigError, match="group_size"):
        create_method("palu", {"group_size": 0})
    for tile in ("64x4", "64x4x5x0x0x8x7", "0x4x5", "64xfourx5", "64x4x5x0x0x8x3x1"):
        with pytest.raises(SparseConfigError, match="decode_tile"):
            create_method("palu", {"decode_tile": tile})
    store = PaluStore(0.5, 1, decode_tile="64x4x5x0x32x8x0x1")  # D 32: 16 frequencies, not chunks of 32
    with pytest.raises(ValueError, match="decode_tile for 32-dim heads: freq_chunk 32"):
        store.load_model(_model(1)[0])
    store = PaluStore(0.5, 3)
    with pytest.raises(ValueError, match="does not divide"):
        store.load_model(_model(1)[0])
    store = PaluStore(0.5, 1)
    with pytest.raises(ValueError, match="needs each token's position"):
        store.load_model(_model(1)[0])
        store.allocate(KVGeometry(LAYERS, HQ, HKV, D, 1, 8, torch.float32, torch.device("cpu")))
        store.write(0, torch.tensor([1]), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D), torch.tensor([0]), True)


def _whitened_reference(w: torch.Tensor, xs: torch.Tensor, x: torch.Tensor, group_size: int, rank: int,
                        ridge: float) -> torch.Tensor:
    """Palu's calibrated factorization from its definition: ``C = X^T X / n + ridge * mean(diag) * I`` over the
    calibration inputs ``xs``; per group ``W_g C^1/2 = U S V^T``, ``B = U_r S_r``, ``A = V_r^T C^-1/2``; read
    ``B A x``."""
    c = xs.double().T @ xs.double() / xs.shape[0]
    c = c + ridge * c.diagonal().mean() * torch.eye(c.shape[0], dtype=torch.float64)
    e, q = torch.linalg.eigh(c)
    c_half, c_inv_half = (q * e.sqrt()) @ q.T, (q / e.sqrt()) @ q.T
    out = []
    for g in range(HKV // group_size):
        wg = w[g * group_size * D:(g + 1) * group_size * D].double()
        u, s, vh = torch.linalg.svd(wg @ c_half, full_matrices=False)
        b, a = u[:, :rank] * s[:rank], vh[:rank] @ c_inv_half
        out.append((x.double() @ a.T) @ b.T)
    return torch.cat(out, dim=-1).view(x.shape[0], HKV, D)


@pytest.mark.parametrize("group_size", [1, 2])
def test_calibrated_bases_are_palus_whitened_svd(group_size: int) -> None:
    """The calibrated store projects onto the top eigenvectors of the K/V second moments (``sgl_sparse.prepare``'s
    ``W C W^T`` with the ridge): the same reconstruction as Palu's SVD of ``W C^1/2``."""
    from sgl_sparse.contract import KVMoments
    from sgl_sparse.contract.model import head_digests
    from sgl_sparse.prepare import RIDGE

    model, weights = _model(group_size)
    gen = torch.Generator().manual_seed(7)
    mix = torch.randn(HIDDEN, HIDDEN, generator=gen) * torch.linspace(0.05, 2.0, HIDDEN)  # anisotropic inputs
    xs = torch.randn(500, HIDDEN, generator=gen) @ mix
    ks, vs, kh, vh = [], [], [], []
    for wk, wv in weights:
        c = xs.double().T @ xs.double() / xs.shape[0]
        ridge = RIDGE * c.diagonal().mean()
        for w, out, heads in ((wk, ks, kh), (wv, vs, vh)):
            y = xs.double() @ w.double().T
            out.append(y.T @ y / xs.shape[0] + ridge * (w.double() @ w.double().T))
            heads.append(head_digests(w, D))
    moments = KVMoments(ks, vs, kh, vh, D, "test", xs.shape[0])
    calibrated = ModelKV(model.layers, HKV, D, D, model.rotary, calibrate=lambda source, tokens: moments)
    store = PaluStore(0.5, group_size, calibration="synthetic")
    store.load_model(calibrated)
    store.allocate(KVGeometry(LAYERS, HQ, HKV, D, 1, 64, torch.float32, torch.device("cpu")))
    rank = group_rank(group_size * D, 0.5)
    x = torch.randn(20, HIDDEN, generator=gen) @ mix
    pos = torch.arange(20) * 7
    wk, wv = weights[1]
    k = _rope_ref((x @ wk.T).view(20, HKV, D), pos, D, True).float()
    got_k, got_v = store.round_trip(1, k, (x @ wv.T).view(20, HKV, D), pos)
    want_k = _rope_ref(_whitened_reference(wk, xs, x, group_size, rank, RIDGE), pos, D, True)
    want_v = _whitened_reference(wv, xs, x, group_size, rank, RIDGE)
    scale = want_k.abs().max()
    torch.testing.assert_close(got_k.double() / scale, want_k / scale, rtol=0, atol=2e-4)
    torch.testing.assert_close(got_v.double() / scale, want_v / scale, rtol=0, atol=2e-4)
    # and it is not the plain SVD's: calibration changed the basis
    plain, _ = _store(0.5, group_size)
    assert (plain.round_trip(1, k, (x @ wv.T).view(20, HKV, D), pos)[0] - got_k).abs().max() > 1e-2
    # a shard whose heads the moments do not know is refused
    other = ModelKV(_model(group_size, seed=9)[0].layers, HKV, D, D, model.rotary,
                    calibrate=lambda source, tokens: moments)
    with pytest.raises(ValueError, match="another checkpoint"):
        PaluStore(0.5, group_size, calibration="synthetic").load_model(other)


def test_calibration_config_is_checked() -> None:
    with pytest.raises(SparseConfigError, match="calibration"):
        create_method("palu", {"calibration": "/no/such/file.jsonl"})
    with pytest.raises(SparseConfigError, match="calibration_tokens"):
        create_method("palu", {"calibration": "synthetic", "calibration_tokens": 0})
    store = PaluStore(0.5, 1, calibration="synthetic")
    with pytest.raises(ValueError, match="not served here"):
        store.load_model(_model(1)[0])  # a ModelKV without calibrate: tensor parallelism
