"""Palu's write kernel (``kernels/palu_write.py``, what ``PaluStore.write`` runs on CUDA) at serving shapes against
float64 projections of the same pre-rotary K and V, within one bf16 unit in the last place plus the fp32 error of
the sum (a latent that cancels to near 0 is not within one ulp of itself from any fp32 sum, the torch path's
included; tests/test_palu_write.py checks the kernel against the definition under the interpreter): a decode batch
captured in a CUDA graph and replayed over new inputs without a host sync, and an extend."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse.contract import AttentionProjections, KVGeometry, ModelKV, RotaryTable
from sgl_sparse.integration.syncs import sync_debug
from sgl_sparse.kernels.rope import rotate
from sgl_sparse.methods.compression.palu import PaluStore

pytestmark = pytest.mark.gpu
DEV = "cuda"
HKV, D, HIDDEN, MAX_POS, SLOTS = 8, 128, 4096, 131_072, 1 << 20  # Llama-3-8B's KV heads, a pool of 1M slots


def _table() -> torch.Tensor:
    inv = 1.0 / 500_000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1).float()


def _store(ratio: float, group_size: int, neox: bool) -> PaluStore:
    gen = torch.Generator().manual_seed(0)
    layer = AttentionProjections(torch.randn(HKV * D, HIDDEN, generator=gen) / math.sqrt(HIDDEN),
                                 torch.randn(HKV * D, HIDDEN, generator=gen) / math.sqrt(HIDDEN))
    store = PaluStore(ratio, group_size)
    store.load_model(ModelKV((layer,), HKV, D, D, RotaryTable(_table(), D, neox)))
    store.allocate(KVGeometry(1, HKV * 4, HKV, D, 1, SLOTS, torch.bfloat16, torch.device(DEV)))
    return store


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-RoPE K and V ``[n, HKV, D]`` bf16 as views into one qkv-like row, positions and distinct slots."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qkv = torch.randn(n, 6 * HKV, D, generator=gen, device=DEV).to(torch.bfloat16)
    positions = torch.randint(0, MAX_POS, (n,), generator=gen, device=DEV)
    loc = torch.randperm(SLOTS - 1, generator=gen, device=DEV)[:n] + 1
    return qkv[:, 4 * HKV:5 * HKV], qkv[:, 5 * HKV:], positions, loc


def assert_rounded_from(got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> None:
    """bf16 ``got`` is ``exact`` (float64) rounded, up to one bf16 unit in the last place and the fp32 error of a
    sum whose terms' magnitudes add to ``scale``: a latent that cancels to near 0 keeps the absolute error of its
    terms, not one ulp of itself."""
    g = got.double()
    mag = torch.maximum(g.abs(), exact.abs())
    ulp = torch.ldexp(torch.ones_like(mag), torch.frexp(mag).exponent - 8)  # bf16: 8 significant bits
    err = (g - exact).abs()
    bound = ulp + 2.0**-16 * scale
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, worst against its bound {(err / bound).max():.3g}"


def _check(store: PaluStore, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor) -> None:
    """The stored latents against float64 projections of the same fp32 pre-rotary K and V onto the same bases."""
    r = store.rotary
    assert r is not None
    n = k.shape[0]
    pre = rotate(k, r.cos_sin[positions.long()], r.rotary_dim, r.neox, inverse=True).double()
    for got, x, basis in ((store.zk[0][loc], pre, store.k_basis[0]), (store.zv[0][loc], v.double(), store.v_basis[0])):
        x = x.reshape(n, basis.shape[0], basis.shape[1])
        b = basis.double()
        assert_rounded_from(got, torch.einsum("ngd,gdr->ngr", x, b), torch.einsum("ngd,gdr->ngr", x.abs(), b.abs()))
    assert torch.equal(store.pos[0][loc], positions.to(torch.int32))


@pytest.mark.parametrize(("group_size", "neox"), [(1, True), (2, False)])
def test_decode_write_kernel_in_a_cuda_graph_matches_torch_without_a_host_sync(group_size: int, neox: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """48 tokens (rank 64 of a head, or 128 of a group of two): captured, replayed, and replayed again over new
    inputs copied into the captured buffers; every slot but the written ones still zero."""
    store = _store(0.5, group_size, neox)
    k, v, positions, loc = _inputs(48, seed=1)
    rows = torch.zeros(48, dtype=torch.int64, device=DEV)

    def write() -> None:
        store.write(0, loc, k, v, rows, decode=True, positions=positions)

    with sync_debug("error"):
        write()  # compiles; eager
    torch.cuda.synchronize()
    _check(store, k, v, positions, loc)
    for t in (store.zk[0], store.zv[0], store.pos[0]):
        t.zero_()
    encode = store._encode
    monkeypatch.setattr(store, "_encode", lambda *a: pytest.fail("the CUDA write took the torch path"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sync_debug("error"):  # the capture's own synchronize outside the check
        write()
    with sync_debug("error"):
        graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(store, "_encode", encode)
    _check(store, k, v, positions, loc)
    written = (store.zk[0] != 0).flatten(1).any(1) | (store.zv[0] != 0).flatten(1).any(1) | (store.pos[0] != 0)
    assert bool(written[loc].all()) and int(written.sum()) == 48, "a slot not in loc written"
    k2, v2, positions2, loc2 = _inputs(48, seed=2)
    for dst, src in ((k, k2), (v, v2), (positions, positions2), (loc, loc2)):
        dst.copy_(src)
    with sync_debug("error"):
        graph.replay()
    torch.cuda.synchronize()
    _check(store, k, v, positions, loc)


def test_extend_write_kernel_matches_torch() -> None:
    """A prefill chunk of 2,048 tokens at rank ratio 0.75 (rank 96: padded to 128 in the kernel)."""
    store = _store(0.75, 1, True)
    k, v, positions, loc = _inputs(2048, seed=3)
    store.write(0, loc, k, v, torch.zeros(2048, dtype=torch.int64, device=DEV), decode=False, positions=positions)
    _check(store, k, v, positions, loc)
