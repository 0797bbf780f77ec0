"""Palu on the GPU: its decode kernel at serving shapes against the store's torch path (no host sync), and servers
(quality-large, bf16, FlashInfer base for new tokens and the reconstructed prefix) with CUDA graphs on and off,
against vanilla FlashInfer bf16 at rank ratio 0.75, and leak-free.

Also ``snapkv+palu``: at a covering budget the same tokens as Palu alone, and at a small one graphs = eager.

Passed 11 of 11 on an H100 (2026-12-07, the keys-as-rows kernel served), so Palu alone and under an eviction method
serve on CUDA by default.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from gpu_common import (
    COMPOSE_COVERING,
    COMPOSE_SMALL,
    SELECTION_LENS,
    assert_idle_and_sound,
    assert_same_tokens,
    check_composition_evicts_and_graphs_equal_eager,
    check_covering_equals_store,
    generate,
    ours,
    prose,
    state,
    token_agreement,
    vanilla,
)

from sgl_sparse.contract import AttentionProjections, KVGeometry, KVStore, ModelKV, RotaryTable
from sgl_sparse.integration.syncs import sync_debug
from sgl_sparse.kernels import palu_attention
from sgl_sparse.methods.compression.palu import PaluStore
from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu
DEV = "cuda"
HKV, G, D, HIDDEN = 8, 4, 128, 4096  # Llama-3-8B's attention


def _table(max_pos: int) -> torch.Tensor:
    inv = 1.0 / 500_000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1).float()


@pytest.mark.parametrize(("ratio", "tile"), [
    (0.5, None), (0.75, None),
    (0.5, palu_attention.Tile(64)), (0.5, palu_attention.Tile(64, angles=palu_attention.BY_TILE)),
    (0.5, palu_attention.Tile(64, stages=5, query_rows=8, key_rows=True, angles=palu_attention.BY_INDEX)),
    (0.5, palu_attention.Tile(64, stages=5, query_rows=8, key_rows=True, freq_chunk=32)),
    (0.5, palu_attention.Tile(64, stages=5, query_rows=8, key_rows=True, angles=palu_attention.ROW_CHECKED)),
    (0.5, palu_attention.Tile(64, stages=9, query_rows=8, key_rows=True, angles=palu_attention.SPLIT_CHECKED)),
    (0.75, palu_attention.Tile(32)),
])
def test_decode_kernel_at_a_serving_shape_matches_torch_without_a_host_sync(ratio: float,
                                                                             tile: palu_attention.Tile | None) -> None:
    """6 requests of up to 9K tokens in rows 131,072 wide, plus 2 CUDA-graph padding rows (length 1), the even rows'
    positions their indices, the odd rows' not; the served tile (None: the keys-as-rows kernel) and others."""
    lens = [9000, 4097, 16, 1, 8191, 3000, 1, 1]
    store, r2t, q = _serving_layer(ratio, lens, rows=6, seed=0)
    rpi = torch.tensor([1, 2, 3, 4, 5, 6, 0, 0], device=DEV)
    seq = torch.tensor(lens, device=DEV)
    got = _kernel(store, tile, q, r2t, rpi, seq)
    want = KVStore.decode(store, 0, q, r2t, rpi, seq, D**-0.5)  # the contract's torch default: read, attend
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _serving_layer(ratio: float, lens: list[int], rows: int, seed: int,
                   q_scale: float = 1.0) -> tuple[PaluStore, torch.Tensor, torch.Tensor]:
    """One layer of a Palu store at Llama-3-8B's attention with rows 1..``rows`` of ``lens`` tokens written
    (``req_to_token`` 131,072 wide; entries past ``rows``: CUDA-graph padding, read from row 0), the even rows'
    positions their indices, the odd rows' shifted; queries for every entry of ``lens``, times ``q_scale`` (larger:
    attention on fewer keys, so a score's error shows in the output)."""
    gen = torch.Generator().manual_seed(seed)
    layer = AttentionProjections(torch.randn(HKV * D, HIDDEN, generator=gen) / math.sqrt(HIDDEN),
                                 torch.randn(HKV * D, HIDDEN, generator=gen) / math.sqrt(HIDDEN))
    store = PaluStore(ratio, 1)
    store.load_model(ModelKV((layer,), HKV, D, D, RotaryTable(_table(131_072), D, True)))
    n_slots = sum(lens) + 8
    store.allocate(KVGeometry(1, HKV * G, HKV, D, 1, n_slots, torch.bfloat16, torch.device(DEV)))
    assert store.rotary is not None
    r2t = torch.zeros(rows + 1, 131072, dtype=torch.int32)
    perm = torch.randperm(n_slots - 1, generator=gen) + 1
    at = 0
    for row, n in enumerate(lens[:rows], start=1):
        r2t[row, :n] = perm[at:at + n].to(torch.int32)
        k = torch.randn(n, HKV, D, generator=gen).to(DEV, torch.bfloat16)
        v = torch.randn(n, HKV, D, generator=gen).to(DEV, torch.bfloat16)
        store.write(0, r2t[row, :n].to(DEV).long(), k, v, torch.full((n,), row, device=DEV), decode=False,
                    positions=torch.arange(n, device=DEV) + 1000 * (row % 2) * row)
        at += n
    return store, r2t.to(DEV), (torch.randn(len(lens), HKV * G, D, generator=gen) * q_scale).to(DEV, torch.bfloat16)


def _kernel(store: PaluStore, tile: palu_attention.Tile | None, q: torch.Tensor, r2t: torch.Tensor,
            rpi: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Palu's decode kernel over layer 0 at ``tile`` (None: the served one), under the host-sync check."""
    table = store.kernel_cos_sin if tile is None else palu_attention.table_for(tile, store.kernel_cos_sin)
    with sync_debug("error"):
        return palu_attention.decode_attention(q, store.zk[0], store.zv[0], store.pos[0], store.k_basis[0],
                                               store.v_basis[0], table, True, r2t, rpi, seq, D**-0.5, tile=tile)


def test_split_checked_kernel_at_peaky_attention_matches_torch() -> None:
    """The split check (``SPLIT_CHECKED``) against the store's torch path where a score's error shows: queries 4x
    (attention on a few keys), a short row and long ones at their indices beside shifted ones; within 2% of the
    output's largest value (the bf16 rounding of the rotated keys and queries; the served tile's error here is
    ~0.7%)."""
    lens = [9000, 4097, 300, 200, 8191, 3000]
    store, r2t, q = _serving_layer(0.5, lens, rows=len(lens), seed=1, q_scale=4.0)
    rpi = torch.arange(1, len(lens) + 1, device=DEV)
    seq = torch.tensor(lens, device=DEV)
    want = KVStore.decode(store, 0, q, r2t, rpi, seq, D**-0.5).float()
    for tile in (None, palu_attention.Tile(64, stages=9, query_rows=8, key_rows=True,
                                           angles=palu_attention.SPLIT_CHECKED)):
        got = _kernel(store, tile, q, r2t, rpi, seq)
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err < 2e-2, f"{tile}: {err:.2e}"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    cfg, sync = {"rank_ratio": 0.75}, {"SGLSPARSE_SYNC_DEBUG": "error"}
    procs = {
        "vanilla": vanilla("palu-vanilla-flashinfer"),
        "palu": ours("palu-graph", "palu", cfg, env=sync),
        "palu-eager": ours("palu-eager", "palu", cfg, extra=["--disable-cuda-graph"]),
        "covering": ours("snapkv-palu-covering", "snapkv+palu", {**COMPOSE_COVERING, "palu": cfg}, env=sync),
        "small": ours("snapkv-palu-small", "snapkv+palu", {**COMPOSE_SMALL, "palu": cfg}, env=sync),
        "small-eager": ours("snapkv-palu-small-eager", "snapkv+palu", {**COMPOSE_SMALL, "palu": cfg},
                            extra=["--disable-cuda-graph"]),
    }
    with running(*procs.values()):
        yield procs


def test_server_serves_the_latent_pool(servers: dict[str, ServerProcess]) -> None:
    st = state(servers["palu"])["kv_store"]
    assert st["class"] == "PaluStore" and st["pool_class"] == "SparseStorePool" and st["capacity_vs_model_dtype"] > 1


def test_cuda_graphs_on_and_off_give_the_same_tokens(servers: dict[str, ServerProcess]) -> None:
    prompts = [prose(700 + i, n) for i, n in enumerate(SELECTION_LENS)]
    eager = generate(servers["palu-eager"], prompts, 96)
    graph = generate(servers["palu"], prompts, 96)
    assert_same_tokens(eager, graph, "palu eager", "palu graph", "batch of 5")
    for name in ("palu", "palu-eager"):
        assert_idle_and_sound(servers[name])


def test_greedy_text_near_vanilla_bf16_at_rank_ratio_three_quarters(servers: dict[str, ServerProcess]) -> None:
    """The trained model on its own prose, 2-6K prompts: greedy continuations near vanilla bf16's (0.6 is the bar:
    the latents drop a quarter of every head's dimensions)."""
    prompts = [prose(800 + i, n) for i, n in enumerate(SELECTION_LENS * 2)]
    same = token_agreement(generate(servers["vanilla"], prompts, 48), generate(servers["palu"], prompts, 48))
    assert same >= 0.6, same
    assert_idle_and_sound(servers["palu"])


def test_snapkv_over_palu_at_a_covering_budget_serves_exactly_palu_alone(servers: dict[str, ServerProcess]) -> None:
    """Nothing evicted: every request reads the same latents through the compacted lists as Palu alone reads
    through its rows (later chunks: the compacted prefix reconstructed), so the tokens are the same."""
    check_covering_equals_store(servers, "palu", "snapkv+palu", 1300)


def test_snapkv_over_palu_evicts_and_graphs_equal_eager(servers: dict[str, ServerProcess]) -> None:
    """SnapKV 1,024 over Palu (its scores read the reconstructed keys): each request keeps its budget, the graph
    server (our decode code raising on a host sync) gives the eager server's tokens, and nothing leaks."""
    check_composition_evicts_and_graphs_equal_eager(servers, "snapkv+palu", 1400)
