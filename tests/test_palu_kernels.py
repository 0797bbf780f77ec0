"""Palu's Triton decode kernel (``kernels/palu_attention.py``) against the store's plain-torch decode (which
reconstructs each row through ``PaluStore.read`` and attends), at small shapes under the Triton interpreter:
:func:`test_palu_kernel_under_the_interpreter` checks them in the session's interpreted run (tests/interpreted.py).
Rows of different lengths, sentinel-free and reordered slots, grouped heads, both rotary layouts, ranks that are
not powers of two, and a split that reads nothing."""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.contract import AttentionProjections, KVGeometry, ModelKV, RotaryTable
from sgl_sparse.kernels.palu_attention import BY_INDEX, BY_ROW, BY_TILE, ROW_CHECKED, SPLIT_CHECKED, Tile
from sgl_sparse.methods.compression.palu import PaluStore

D, HIDDEN = 32, 128


def _table(max_pos: int, d: int = D, base: float = 10_000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1).float()


def _filled(hkv: int, hq: int, ratio: float, group_size: int, neox: bool, lens: list[int],
            seed: int, d: int = D, gap: int = 0,
            at_index: bool = False) -> tuple[PaluStore, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A store with rows of ``lens`` tokens at consecutive positions (from ``gap`` on past its middle, as after an
    eviction; ``at_index``: each row's positions its row indices, as an uncompacted request's) and one query a
    row."""
    gen = torch.Generator().manual_seed(seed)
    layers = tuple(AttentionProjections(torch.randn(hkv * d, HIDDEN, generator=gen) / math.sqrt(HIDDEN),
                                        torch.randn(hkv * d, HIDDEN, generator=gen) / math.sqrt(HIDDEN))
                   for _ in range(2))
    store = PaluStore(ratio, group_size)
    store.load_model(ModelKV(layers, hkv, d, d, RotaryTable(_table(16_384, d), d, neox)))
    width = max(lens) + 8
    slots = len(lens) * width + 16
    store.allocate(KVGeometry(2, hq, hkv, d, 1, slots, torch.float32, torch.device("cpu")))
    table = torch.zeros(len(lens) + 1, width, dtype=torch.int64)
    perm = torch.randperm(slots - 1, generator=gen) + 1  # slots scattered over the pool, 0 unused
    at = 0
    for r, n in enumerate(lens, start=1):
        table[r, :n] = perm[at:at + n]
        at += n
        x = torch.randn(n, HIDDEN, generator=gen)
        k = (x @ layers[1].k_weight.T).view(n, hkv, d)
        v = (x @ layers[1].v_weight.T).view(n, hkv, d)
        pos = torch.arange(n) + (0 if at_index else 3000 * r)  # positions far into the rotary table, or the rows
        pos[n // 2:] += gap
        store.write(1, table[r, :n], k, v, torch.full((n,), r), decode=False, positions=pos)
    # slot 0, which no row holds, as the padding slot of a served pool: written (by padded decode rows), finite
    store.zk[1][0], store.zv[1][0], store.pos[1][0] = 50.0, -50.0, 7
    q = torch.randn(len(lens), hq, d, generator=gen)
    return store, table, torch.arange(1, len(lens) + 1), q


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
@pytest.mark.parametrize(("hkv", "hq", "ratio", "group_size", "neox", "lens", "splits"), [
    (2, 4, 0.5, 1, True, [37, 5, 90], 4),
    (4, 4, 0.75, 2, True, [64, 1], 3),  # group of 2 heads: rank 48, not a power of two
    (2, 8, 0.5, 1, False, [50, 20], 16),  # interleaved pairs; splits past a short row's end read nothing
])
@pytest.mark.parametrize("key_rows", [False, True])
def test_decode_kernel_matches_the_torch_path(hkv: int, hq: int, ratio: float, group_size: int, neox: bool,
                                              lens: list[int], splits: int, key_rows: bool) -> None:
    """Both loops; the rank 48 one reads latents padded to 64 (masked) and a slot past a row's end reads slot 0."""
    from sgl_sparse.kernels import palu_attention

    store, table, rows, q = _filled(hkv, hq, ratio, group_size, neox, lens, seed=hkv + hq)
    seq = torch.tensor(lens)
    want = store.decode(1, q, table, rows, seq, D ** -0.5)  # the torch default: read() then attend
    rot = store.rotary
    assert rot is not None
    got = palu_attention.decode_attention(q, store.zk[1], store.zv[1], store.pos[1], store.k_basis[1],
                                          store.v_basis[1], rot.cos_sin, rot.neox, table, rows, seq, D ** -0.5,
                                          splits=splits, tile=Tile(16, key_rows=key_rows))
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
@pytest.mark.parametrize(("tile", "int32_offsets", "gap"), [
    (Tile(16, freq_chunk=16), True, 0),
    (Tile(16, freq_chunk=32, query_rows=4), True, 0),
    (Tile(16, freq_chunk=16), False, 0),
    (Tile(16, freq_chunk=16, angles=BY_TILE), True, 0),
    (Tile(16, freq_chunk=32, angles=BY_TILE), True, 5),
    (Tile(16, key_rows=True), True, 0),
    (Tile(32, key_rows=True, angles=BY_TILE), False, 5),
    (Tile(16, freq_chunk=16, angles=BY_INDEX), True, 5),
    (Tile(16, freq_chunk=32, angles=BY_INDEX), False, -3010),
    (Tile(32, key_rows=True, angles=BY_INDEX), True, -3010),
    (Tile(16, key_rows=True, freq_chunk=16), True, 5),
    (Tile(32, key_rows=True, freq_chunk=16, angles=BY_INDEX), False, -3010),
])
def test_decode_kernel_by_tile_and_offset_width(monkeypatch: pytest.MonkeyPatch, tile: Tile, int32_offsets: bool,
                                                gap: int) -> None:
    """A 64-dim head reconstructed 16 or all 32 frequencies at a time, with the pool's offsets in int32 (what a
    pool under 2**31 elements gets) and in int64 (what a larger one gets, reached here by lowering the limit);
    the group's 4 query heads padded to the tensor cores' 16 rows or not padded; angles gathered a position or
    rotated from a tile's smallest position or its first row index, over consecutive positions and over rows with a
    gap (whose tiles across it read farther rows), one of them (gap -3,010) with positions before their row index;
    the keys-as-rows kernel, all frequencies at once or in two chunks."""
    from sgl_sparse.kernels import palu_attention

    if not int32_offsets:
        monkeypatch.setattr(palu_attention, "INT32_LIMIT", 0)
    d = 64
    store, table, rows, q = _filled(2, 8, 0.5, 1, True, [40, 7, 70], seed=11, d=d, gap=gap)
    seq = torch.tensor([40, 7, 70])
    want = store.decode(1, q, table, rows, seq, d ** -0.5)
    rot = store.rotary
    assert rot is not None
    args = (q, store.zk[1], store.zv[1], store.pos[1], store.k_basis[1], store.v_basis[1], rot.cos_sin, rot.neox,
            table, rows, seq, d ** -0.5)
    if tile.angles == BY_INDEX:
        with pytest.raises(AssertionError, match="mirrored"):
            palu_attention.decode_attention(*args, splits=3, tile=tile)
        args = (*args[:6], palu_attention.mirrored(rot.cos_sin), *args[7:])
    got = palu_attention.decode_attention(*args, splits=3, tile=tile)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="freq_chunk"):
        palu_attention.decode_attention(*args, tile=tile._replace(freq_chunk=8))


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
@pytest.mark.parametrize("key_rows", [False, True])
def test_decode_kernel_in_the_model_dtype_matches_the_torch_path(key_rows: bool) -> None:
    """The GPU's form (``native``: score and value dots in the model dtype, an fp16 rotary table) at an fp16
    model (the interpreter has no bf16 dot): within the model dtype's rounding of the fp32 path."""
    from sgl_sparse.kernels import palu_attention

    store, table, rows, q = _filled(4, 8, 0.5, 1, True, [37, 50, 5], seed=3)
    seq = torch.tensor([37, 50, 5])
    want = store.decode(1, q, table, rows, seq, D ** -0.5)
    rot = store.rotary
    assert rot is not None
    got = palu_attention.decode_attention(q.half(), store.zk[1].half(), store.zv[1].half(), store.pos[1],
                                          store.k_basis[1].half(), store.v_basis[1], rot.cos_sin.half(), rot.neox,
                                          table, rows, seq, D ** -0.5, splits=4, native=True,
                                          tile=Tile(16, key_rows=key_rows))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=3e-3, atol=3e-3)


def test_each_rank_gets_the_served_tile_of_the_smallest_rank_covering_it() -> None:
    """Rank ratio 0.25 of a 128-dim head (rank 32) decodes with rank 64's tile, not the widest rank's (whose 128
    positions a tile were chosen for rank 96 padded to 128); 0.75 with 128's; a rank past every entry the widest."""
    from sgl_sparse.kernels.palu_attention import CUDA_TILES, cuda_tile

    assert sorted(CUDA_TILES) == [64, 128]
    assert cuda_tile(32) == cuda_tile(64) == CUDA_TILES[64] != CUDA_TILES[128]
    assert cuda_tile(128) == cuda_tile(256) == CUDA_TILES[128]


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_palu_kernel_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
@pytest.mark.parametrize("key_rows", [False, True])
def test_angles_by_row_index_equal_the_gathered_ones_where_positions_are_indices(key_rows: bool) -> None:
    """``BY_ROW`` (the row index taken as the position, no position gather) against the torch path on rows whose
    positions are their indices, and away from it where they are not (a compacted row's): what it assumes.
    ``ROW_CHECKED`` equals the torch path on both: a tile whose positions are not its indices gathers again; so
    does ``SPLIT_CHECKED`` (keys-as-rows only), whose splits of rows at their indices turn keys by tile offset."""
    from sgl_sparse.kernels import palu_attention

    d = 64
    for at_index, gap in ((True, 0), (True, 5), (False, 5)):  # (True, 5): a row's first half at its indices
        store, table, rows, q = _filled(2, 8, 0.5, 1, True, [40, 7, 70], seed=12, d=d, gap=gap, at_index=at_index)
        seq = torch.tensor([40, 7, 70])
        want = store.decode(1, q, table, rows, seq, d ** -0.5)
        rot = store.rotary
        assert rot is not None
        got = palu_attention.decode_attention(q, store.zk[1], store.zv[1], store.pos[1], store.k_basis[1],
                                              store.v_basis[1], rot.cos_sin, rot.neox, table, rows, seq, d ** -0.5,
                                              splits=3, tile=Tile(16, angles=BY_ROW, key_rows=key_rows))
        if at_index and not gap:
            torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
        else:
            assert (got - want).abs().max() > 1e-2
        checked = [Tile(16, angles=ROW_CHECKED, key_rows=key_rows)]
        if key_rows:  # the split check: two frequency chunks or one
            checked += [Tile(16, angles=SPLIT_CHECKED, key_rows=True, freq_chunk=16),
                        Tile(16, angles=SPLIT_CHECKED, key_rows=True, stages=7)]
        for tile in checked:
            got = palu_attention.decode_attention(q, store.zk[1], store.zv[1], store.pos[1], store.k_basis[1],
                                                  store.v_basis[1], rot.cos_sin, rot.neox, table, rows, seq,
                                                  d ** -0.5, splits=3, tile=tile)
            torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4, msg=lambda m, t=tile: f"{t}: {m}")
        if key_rows and at_index and not gap:
            # every split at its indices: the split check's loop reads the table's first rows and the tiles' first
            # rows only, so a row neither of those (17) changes nothing there and the gathered loop's scores
            bad = rot.cos_sin.clone()
            bad[17] = 0.0
            args = (q, store.zk[1], store.zv[1], store.pos[1], store.k_basis[1], store.v_basis[1], bad, rot.neox,
                    table, rows, seq, d ** -0.5)
            split = palu_attention.decode_attention(*args, splits=3, tile=Tile(16, angles=SPLIT_CHECKED, key_rows=True))
            torch.testing.assert_close(split, want, rtol=2e-4, atol=2e-4)
            gathered = palu_attention.decode_attention(*args, splits=3, tile=Tile(16, key_rows=True))
            assert (gathered - want).abs().max() > 1e-2
