"""Tensor parallelism: every TP rank must pick the identical keep set (docs/parallelism.md).

Two real processes in a gloo group, each holding a different half of the KV heads (and their query heads), so
each scores different local values; after the scores' all-reduce both must keep the same positions, equal to
what one process holding every head keeps. Without the all-reduce (the rank's own heads only) the ranks'
sets differ on these inputs, so the test fails if a method stops reducing. A tie case checks the position
tie-break, and one test goes through SGLang's own TP group coordinator (``integration/tp.py``) over gloo.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sgl_sparse.contract import AllReduce, ObservationWindow, RequestState, SparseMethod, StepInfo
from sgl_sparse.methods.eviction.base import topk_keep
from sgl_sparse.registry import create_method
from sgl_sparse.server_process import free_port

WORLD = 2
LAYERS, HQ, HKV, D = 3, 8, 4, 16  # each rank: 2 KV heads, their 4 query heads
N, W = 96, 8  # prompt tokens, window queries
NO_NCCL = "/nonexistent/libnccl.so.2"

# (method, config): every eviction method that scores; budgets well under N so most of the middle is cut.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("snapkv", {"budget": 40, "window_size": W, "sink_tokens": 4, "kernel_size": 5}),
    ("snapkv", {"budget": 40, "window_size": W, "sink_tokens": 4, "kernel_size": 1, "pooling": "maxpool"}),
    ("h2o", {"budget": 40, "window_size": W, "evict_interval": 0}),
    ("rkv", {"budget": 40, "window_size": W, "kernel_size": 7}),
    ("pyramidkv", {"budget": 40, "window_size": W, "sink_tokens": 4, "beta": 4}),
    ("streamingllm", {"sink_tokens": 4, "recent_tokens": 36, "evict_interval": 8}),
]


def _inputs(seed: int, tie: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: window queries ``[W, HQ, D]`` and keys ``[N, HKV, D]``. ``tie``: every key equal, so every
    key before the window gets bitwise the same score and only the tie-break decides."""
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(W, HQ, D, generator=g) for _ in range(LAYERS)]
    if tie:
        ks = [torch.randn(1, HKV, D, generator=g).expand(N, HKV, D).contiguous() for _ in range(LAYERS)]
    else:
        # Heads of different scales, so one rank's heads alone rank positions differently from all of them.
        ks = [torch.randn(N, HKV, D, generator=g) * torch.tensor([0.5, 2.0, 1.0, 3.0])[None, :, None]
              for _ in range(LAYERS)]
    return qs, ks


def _keep(name: str, config: dict[str, Any], qs: list[torch.Tensor], ks: list[torch.Tensor],
          all_reduce: AllReduce | None) -> torch.Tensor:
    """One request's prompt through the method's hooks, as the server's step drives them: the kept positions."""
    method: SparseMethod[Any] = create_method(name, config)
    state: RequestState = method.new_state("r")
    state.advance(N)
    info = StepInfo(is_prefill=True, new_tokens=N, decoded_tokens=0, final_prefill=True)
    window = ObservationWindow(queries=dict(enumerate(qs)), q_pos=torch.arange(N - W, N),
                               key_buffer=lambda layer: ks[layer], key_rows=torch.arange(N), k_pos=torch.arange(N),
                               num_layers=LAYERS, scale=D**-0.5, all_reduce=all_reduce)
    if method.observation_window() > 0 and method.wants_observation(state, info):
        method.on_observation(state, window)
    plan = method.on_step_end(state, info)
    return state.kept if plan is None else plan.keep


SKIPKV = {"budget": 40, "window_size": W, "sink_tokens": 4, "recent_tokens": 16, "redundancy_window": 32,
          "sentence_threshold": 0.0}
SPANS = [(4, 20), (20, 40), (40, 60), (60, 76)]  # closed sentences (decoded tokens) among the candidates


def _skipkv_scores(qs: list[torch.Tensor], ks: list[torch.Tensor], all_reduce: AllReduce | None,
                   sentence_weight: float) -> torch.Tensor:
    """SkipKV scores its candidates in decode (its keep set needs decode steps): its score function directly."""
    from sgl_sparse.methods.eviction.base import over_all_heads
    from sgl_sparse.methods.eviction.skipkv import SkipKVConfig, skipkv_scores

    window = ObservationWindow(queries=dict(enumerate(qs)), q_pos=torch.arange(N - W, N),
                               key_buffer=lambda layer: ks[layer], key_rows=torch.arange(N), k_pos=torch.arange(N),
                               num_layers=LAYERS, scale=D**-0.5, all_reduce=all_reduce)
    local = skipkv_scores(window, SPANS, SkipKVConfig(**SKIPKV, sentence_weight=sentence_weight))[0]
    return over_all_heads(window, local, mean=True)  # as ScoredEviction reduces SkipKV's (head_mean)


def _shard(qs: list[torch.Tensor], ks: list[torch.Tensor], rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's heads, as SGLang's QKV projection shards them: a contiguous block of KV heads and the query
    heads of their GQA groups."""
    kv, q = HKV // WORLD, HQ // WORLD
    return ([x[:, rank * q:(rank + 1) * q].contiguous() for x in qs],
            [x[:, rank * kv:(rank + 1) * kv].contiguous() for x in ks])


def _gloo_sum(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out)
    return out


def _worker(rank: int, port: int, out_dir: str, use_sglang_group: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    reducer: Callable[[torch.Tensor], torch.Tensor] | None
    if use_sglang_group:
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

        from sgl_sparse.integration.tp import scores_all_reduce

        # No GPU here, but a CUDA build of torch ships libnccl, which SGLang's TP group then binds to a CUDA
        # device and fails ("Expected a cuda device, but got: cpu"); a missing library is SGLang's own
        # "non-GPU environment" case (pynccl.py: disabled), leaving the group's gloo all-reduce.
        os.environ["SGLANG_NCCL_SO_PATH"] = NO_NCCL

        init_distributed_environment(world_size=WORLD, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=WORLD)
        reducer = scores_all_reduce()
        assert reducer is not None
    else:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        reducer = _gloo_sum
    results: dict[str, torch.Tensor] = {}
    for seed, tie in ((0, False), (1, False), (2, True)):
        qs, ks = _shard(*_inputs(seed, tie), rank)
        for i, (name, config) in enumerate(CASES):
            results[f"{seed}/{i}/reduced"] = _keep(name, config, qs, ks, reducer)
            results[f"{seed}/{i}/local"] = _keep(name, config, qs, ks, None)
        for weight in (0.0, 1.0):
            results[f"{seed}/skipkv{weight}/reduced"] = _skipkv_scores(qs, ks, reducer, weight)
    if use_sglang_group:
        from sgl_sparse.integration.tp import check_ranks_agree

        check_ranks_agree([torch.arange(5), torch.tensor([1, 7, 9])])  # the same sets on both ranks: no error
        check_ranks_agree([])
        try:
            check_ranks_agree([torch.tensor([0, 1, 2 + rank])])  # rank 1 keeps another position
            results["check_caught"] = torch.tensor(False)
        except RuntimeError:
            results["check_caught"] = torch.tensor(True)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(tmp_path: Path, use_sglang_group: bool) -> list[dict[str, torch.Tensor]]:
    mp.spawn(_worker, args=(free_port(), str(tmp_path), use_sglang_group), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    return _run_ranks(tmp_path_factory.mktemp("tp"), use_sglang_group=False)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_ranks_keep_the_single_process_set(gloo_results: list[dict[str, torch.Tensor]], seed: int, case: int) -> None:
    name, config = CASES[case]
    reference = _keep(name, config, *_inputs(seed, tie=False), None)
    assert reference.numel() < N  # something was evicted, so the choice matters
    for rank in range(WORLD):
        assert torch.equal(gloo_results[rank][f"{seed}/{case}/reduced"], reference), (name, rank)


def test_without_the_all_reduce_the_ranks_diverge(gloo_results: list[dict[str, torch.Tensor]]) -> None:
    """The inputs are such that a rank's own heads pick another set than its peer's: the reduce is needed."""
    for seed in (0, 1):
        for case, (name, _) in enumerate(CASES):
            local = [gloo_results[r][f"{seed}/{case}/local"] for r in range(WORLD)]
            # StreamingLLM has no scores: its set comes from lengths only, identical on every rank anyway.
            assert torch.equal(local[0], local[1]) == (name == "streamingllm"), (name, seed)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_ties_go_to_the_earlier_position_on_every_rank(gloo_results: list[dict[str, torch.Tensor]],
                                                       case: int) -> None:
    name, config = CASES[case]
    reference = _keep(name, config, *_inputs(2, tie=True), None)
    assert torch.equal(gloo_results[0][f"2/{case}/reduced"], gloo_results[1][f"2/{case}/reduced"])
    assert torch.equal(gloo_results[0][f"2/{case}/reduced"], reference), name
    if name in ("snapkv", "h2o"):
        # Every key before the window scores the same (equal keys, all seen by every window query): the
        # earliest of them are kept, as many as the budget leaves.
        dropped = sorted(set(range(N)) - set(reference.tolist()))
        assert dropped == list(range(dropped[0], dropped[-1] + 1)), dropped  # one run...
        assert dropped[-1] < N - W and dropped[0] > 0  # ...ending where the kept recent tokens start


def test_topk_keep_tie_break_after_a_reduce() -> None:
    """Local scores that differ per rank but tie once summed (exact in float): lower positions win."""
    kept = torch.arange(10)
    rank0 = torch.tensor([0.0, 1.0, 3.0, 2.0, 1.0, 3.0, 2.0, 0.0, 0.0, 0.0])
    rank1 = torch.tensor([0.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0])
    total = rank0 + rank1  # positions 1..6 all score 4
    assert torch.equal(total, rank1 + rank0)  # IEEE addition commutes: both ranks' sums are equal
    assert topk_keep(kept, total, budget=5, sink=1, window=1).tolist() == [0, 1, 2, 3, 9]
    assert topk_keep(kept, rank0, budget=5, sink=1, window=1).tolist() != topk_keep(
        kept, rank1, budget=5, sink=1, window=1).tolist()


def test_sglang_tp_group_reduces_scores_on_cpu(tmp_path: Path) -> None:
    """The reducer the server hands to every observation window: SGLang's own TP group coordinator, here over
    gloo on CPU (as a --device cpu server sets it up), gives both ranks the single-process sets."""
    results = _run_ranks(tmp_path, use_sglang_group=True)
    # The digest check (SGLSPARSE_TP_CHECK) passes equal sets and raises on both ranks for different ones.
    assert all(bool(r["check_caught"]) for r in results)
    for seed, tie in ((0, False), (2, True)):
        for case, (name, config) in enumerate(CASES):
            reference = _keep(name, config, *_inputs(seed, tie), None)
            for rank in range(WORLD):
                assert torch.equal(results[rank][f"{seed}/{case}/reduced"], reference), (name, seed, rank)


@pytest.mark.parametrize("seed", [0, 1])
def test_skipkv_scores_are_identical_on_every_rank(gloo_results: list[dict[str, torch.Tensor]], seed: int) -> None:
    """SkipKV's totals are head-weighted means over the ranks: exactly the single-process scores without the
    sentence term; with it (each rank's own heads' cosines, averaged) still bitwise the same on both ranks."""
    reference = _skipkv_scores(*_inputs(seed, tie=False), None, 0.0)
    for rank in range(WORLD):
        torch.testing.assert_close(gloo_results[rank][f"{seed}/skipkv0.0/reduced"], reference)
    assert torch.equal(gloo_results[0][f"{seed}/skipkv1.0/reduced"], gloo_results[1][f"{seed}/skipkv1.0/reduced"])
    assert not torch.equal(gloo_results[0][f"{seed}/skipkv1.0/reduced"], gloo_results[0][f"{seed}/skipkv0.0/reduced"])
