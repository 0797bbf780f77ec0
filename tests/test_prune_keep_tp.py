"""A scored keep under tensor parallelism: every TP rank must keep the same positions (docs/prefix-cache-pruning.md).

Two real processes in a gloo group, each with its own SGLang radix tree, allocator and MHA KV pool holding a
different half of the KV heads (as SGLang shards them), serve and finish the same request, then run the same scored
prune through the server's own path (``prune.keep.pool_scorer`` with ``integration/tp.py``'s all-reduce, SGLang's TP
group coordinator over gloo). Both must keep the positions one process holding every head keeps; without the
all-reduce (each rank's own heads) they keep different ones on these keys, so the test fails if the reduce goes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sgl_sparse.server_process import free_port

WORLD = 2
LAYERS, HKV, D = 3, 4, 8  # each rank: 2 KV heads
NO_NCCL = "/nonexistent/libnccl.so.2"
PROMPT = list(range(100, 140))
RANGES = [(3, 15), (22, 35)]
KEEP = 7


def _keys(seed: int, tie: bool) -> list[torch.Tensor]:
    """Per layer ``[len(PROMPT), HKV, D]``; heads of different scales, so half of them rank positions differently
    from all of them. ``tie``: every position's keys equal (only the position decides)."""
    g = torch.Generator().manual_seed(seed)
    n = len(PROMPT)
    if tie:
        return [torch.randn(1, HKV, D, generator=g).expand(n, HKV, D).contiguous() for _ in range(LAYERS)]
    scale = torch.tensor([0.5, 2.0, 1.0, 3.0])[None, :, None]
    return [torch.randn(n, HKV, D, generator=g) * scale for _ in range(LAYERS)]


def _kept_after_prune(keys: list[torch.Tensor], all_reduce: object) -> torch.Tensor:
    """One request of PROMPT served and finished into a fresh tree whose pool holds ``keys`` (this rank's heads),
    then a scored prune: the positions its continuation still sees."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sgl_sparse.prune import tree_ops
    from sgl_sparse.prune.keep import pool_scorer
    from sgl_sparse.radix.tree import SparseRadixCache
    from sgl_sparse.registry import create_method
    from tests.test_prune import _finished

    heads = keys[0].shape[1]
    kv = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=heads, head_dim=D, layer_num=LAYERS,
                          device="cpu", enable_memory_saver=False)
    req_pool = ReqToTokenPool(size=4, max_context_len=128, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(64, torch.float32, "cpu", kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc, page_size=1)
    m = create_method("streamingllm")
    tree = SparseRadixCache(params, m, m.config.fingerprint())
    seq = _finished(tree, req_pool, alloc, "a", PROMPT, [], 1)
    slots = tree.view_of(seq, None).slots.long()
    for layer in range(LAYERS):
        kv.get_key_buffer(layer)[slots] = keys[layer]
    r = tree_ops.prune(tree, seq, None, RANGES, KEEP, pool_scorer(kv, "knorm", all_reduce))
    assert r.status == "completed" and r.kept_tokens == KEEP, r
    return tree.view_of(seq, None).kept


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SGLANG_NCCL_SO_PATH=NO_NCCL)
    torch.set_num_threads(1)
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    from sgl_sparse.integration.tp import scores_all_reduce

    init_distributed_environment(world_size=WORLD, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=WORLD)
    reducer = scores_all_reduce()
    assert reducer is not None
    half = HKV // WORLD
    results: dict[str, torch.Tensor] = {}
    for seed, tie in ((0, False), (1, False), (2, True)):
        mine = [k[:, rank * half:(rank + 1) * half].contiguous() for k in _keys(seed, tie)]
        results[f"{seed}/reduced"] = _kept_after_prune(mine, reducer)
        results[f"{seed}/local"] = _kept_after_prune(mine, None)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("tp-keep")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_rank_keeps_the_single_process_set(results: list[dict[str, torch.Tensor]], seed: int) -> None:
    reference = _kept_after_prune(_keys(seed, tie=seed == 2), None)
    candidates = sum(hi - lo for lo, hi in RANGES)
    assert reference.numel() == len(PROMPT) - (candidates - KEEP)
    for rank in range(WORLD):
        assert torch.equal(results[rank][f"{seed}/reduced"], reference), (seed, rank)
    if seed == 2:  # equal keys: the earliest KEEP positions of the ranges stay
        kept_in_ranges = [p for p in reference.tolist() if any(lo <= p < hi for lo, hi in RANGES)]
        assert kept_in_ranges == list(range(3, 3 + KEEP))


def test_without_the_all_reduce_the_ranks_diverge(results: list[dict[str, torch.Tensor]]) -> None:
    for seed in (0, 1):
        assert not torch.equal(results[0][f"{seed}/local"], results[1][f"{seed}/local"]), seed
