"""Palu's write kernel (``kernels/palu_write.py``, what ``PaluStore.write`` runs on CUDA) at serving shapes against
the store's torch write, within one bf16 unit in the last place (the two sum the projection in different orders in
fp32 and round once; tests/test_palu_write.py checks the kernel against the definition under the interpreter):
a decode batch captured in a CUDA graph and replayed over new inputs without a host sync, and an extend."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse.contract import AttentionProjections, KVGeometry, ModelKV, RotaryTable
from sgl_sparse.integration.syncs import sync_debug
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


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 ``got`` at most one bf16 unit in the last place from bf16 ``want``."""
    g, w = got.float(), want.float()
    mag = torch.maximum(g.abs(), w.abs())
    ulp = torch.ldexp(torch.ones_like(mag), torch.frexp(mag).exponent - 8)  # bf16: 8 significant bits
    assert bool(((g - w).abs() <= ulp).all()), f"max error {(g - w).abs().max()} over one bf16 ulp"


def _expected(store: PaluStore, k: torch.Tensor, v: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    zk, zv = store._encode(0, k, v, positions)  # the torch path's fp32 latents
    return zk.to(torch.bfloat16), zv.to(torch.bfloat16)


def _check(store: PaluStore, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor) -> None:
    want_k, want_v = _expected(store, k, v, positions)
    assert_within_one_ulp(store.zk[0][loc], want_k)
    assert_within_one_ulp(store.zv[0][loc], want_v)
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
