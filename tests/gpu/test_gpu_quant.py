"""The quantization family on the GPU (``fp8_kv``): its Triton kernels at serving shapes against the torch
references, and servers (FlashInfer base for new tokens, our kernels over the FP8 pool) against vanilla
FlashInfer bf16 and against themselves without CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gpu_common import (
    SELECTION_LENS,
    assert_idle_and_sound,
    assert_same_tokens,
    generate,
    ours,
    prose,
    state,
    token_agreement,
    vanilla,
)

from sgl_sparse.integration.syncs import sync_debug
from sgl_sparse.kernels import fp8_attention as fa
from sgl_sparse.kernels import quant
from sgl_sparse.server_process import ServerProcess, running

pytestmark = pytest.mark.gpu
DEV = "cuda"
HKV, G, D = 8, 4, 128  # Llama-3-8B's attention


def _pool(n_slots: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n_slots, HKV, D, generator=g) * 3).to(DEV, torch.bfloat16)
    v = torch.randn(n_slots, HKV, D, generator=g).to(DEV, torch.bfloat16)
    kc, ks = quant.fp8_quantize(k)
    vc, vs = quant.fp8_quantize(v)
    return kc.view(torch.uint8), ks, vc.view(torch.uint8), vs


def test_decode_kernel_at_a_serving_shape_matches_torch_without_a_host_sync() -> None:
    """6 requests of up to 9K tokens in rows 131,072 wide, plus 2 CUDA-graph padding rows (length 1)."""
    lens = [9000, 4097, 16, 1, 8191, 3000, 1, 1]
    n_slots = sum(lens) + 8
    kc, ks, vc, vs = _pool(n_slots, 0)
    r2t = torch.zeros(7, 131072, dtype=torch.int32)
    perm = torch.randperm(n_slots - 1, generator=torch.Generator().manual_seed(1)) + 1
    at = 0
    for row, n in enumerate(lens[:6], start=1):
        r2t[row, :n] = perm[at:at + n].to(torch.int32)
        at += n
    r2t = r2t.to(DEV)
    rpi = torch.tensor([1, 2, 3, 4, 5, 6, 0, 0], device=DEV)
    seq = torch.tensor(lens, device=DEV)
    q = torch.randn(len(lens), HKV * G, D, generator=torch.Generator().manual_seed(2)).to(DEV, torch.bfloat16)
    args = (q, kc, ks, vc, vs, r2t, rpi, seq, D**-0.5)
    with sync_debug("error"):
        got = fa.decode_attention(*args)
    torch.testing.assert_close(got.float(), fa.decode_attention_torch(*args).float(), atol=2e-2, rtol=2e-2)


def test_prefix_kernel_at_a_serving_shape_matches_torch() -> None:
    """An extend of 3 requests (2,048 new tokens over 6,000 cached, 300 over 12,000, 17 over none)."""
    new, prefix = [2048, 300, 17], [6000, 12000, 0]
    n_slots = sum(prefix) + 8
    kc, ks, vc, vs = _pool(n_slots, 3)
    perm = (torch.randperm(n_slots - 1, generator=torch.Generator().manual_seed(4)) + 1)[: sum(prefix)]
    r2t = torch.zeros(4, 131072, dtype=torch.int32)
    r2t[1, :6000], r2t[2, :12000] = perm[:6000].to(torch.int32), perm[6000:].to(torch.int32)
    qo_indptr = torch.tensor([0, 2048, 2348, 2365], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(new), HKV * G, D, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    args = (q, kc, ks, vc, vs, qo_indptr, r2t.to(DEV), torch.tensor([1, 2, 3], device=DEV),
            torch.tensor(prefix, dtype=torch.int32, device=DEV), D**-0.5)
    got, got_lse = fa.prefix_attention(*args, extend_lens=new)
    ref, ref_lse = fa.prefix_attention_torch(*args)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_lse, ref_lse, atol=2e-2, rtol=1e-3)  # tf32 logits
    assert torch.isinf(got_lse[2348:]).all()


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    procs = {
        "vanilla": vanilla("fp8-vanilla-flashinfer"),
        "fp8": ours("fp8-graph", "fp8_kv", env={"SGLSPARSE_SYNC_DEBUG": "error"}),
        "fp8-eager": ours("fp8-eager", "fp8_kv", extra=["--disable-cuda-graph"]),
        "fp8-kernel": ours("fp8-kernel", "fp8_kv", {"prefix_attention": "kernel"}),
    }
    with running(*procs.values()):
        yield procs


def test_server_serves_the_fp8_pool(servers: dict[str, ServerProcess]) -> None:
    st = state(servers["fp8"])
    assert st["kv_store"]["class"] == "FP8Store" and st["kv_store"]["pool_class"] == "SparseStorePool"
    # Off either way: by our launcher for a store, or by SGLang when the flags already disable it.
    assert "disabled" in st["prefill_cuda_graph"]


def test_cuda_graphs_on_and_off_give_the_same_tokens(servers: dict[str, ServerProcess]) -> None:
    prompts = [prose(700 + i, n) for i, n in enumerate(SELECTION_LENS)]
    eager = generate(servers["fp8-eager"], prompts, 96)
    graph = generate(servers["fp8"], prompts, 96)
    assert_same_tokens(eager, graph, "fp8_kv eager", "fp8_kv graph", "batch of 5")
    for name in ("fp8", "fp8-eager"):
        assert_idle_and_sound(servers[name])


def test_greedy_text_follows_vanilla_bf16(servers: dict[str, ServerProcess]) -> None:
    """The trained model on its own prose, 2-6K prompts: FP8 KV keeps greedy continuations on vanilla bf16's
    path for most of 48 tokens (0.8 is the bar)."""
    prompts = [prose(800 + i, n) for i, n in enumerate(SELECTION_LENS * 2)]
    ref = generate(servers["vanilla"], prompts, 48)
    got = generate(servers["fp8"], prompts, 48)
    same = token_agreement(ref, got)
    assert same >= 0.8, same
    assert_idle_and_sound(servers["fp8"])


def test_a_dequantized_prefix_follows_the_kernel(servers: dict[str, ServerProcess]) -> None:
    """``prefix_attention`` ``auto`` (the default) reads the prefix dequantized on FlashInfer: 2-6K prompts in 2,048
    token chunks, the later chunks reading their prefix through FlashInfer's ragged prefill (non-causal, merged by
    log-sum-exp) instead of the Triton prefix kernel (``kernel``): the same FP8 values, so greedy continuations stay
    on the kernel server's path (rounding apart)."""
    served = state(servers["fp8"])["kv_store"]
    assert served["prefix_attention"] == "dequantize" and served["prefix_attention_config"] == "auto"
    assert state(servers["fp8-kernel"])["kv_store"]["prefix_attention"] == "kernel"
    prompts = [prose(900 + i, n) for i, n in enumerate(SELECTION_LENS * 2)]
    ref = generate(servers["fp8-kernel"], prompts, 48)
    got = generate(servers["fp8"], prompts, 48)
    same = token_agreement(ref, got)
    assert same >= 0.9, same
    assert_idle_and_sound(servers["fp8"])
    assert_idle_and_sound(servers["fp8-kernel"])
