"""TurboQuant's Triton kernels (sgl_sparse/kernels/turboquant_attention.py) against the store's torch path
(``TurboQuantStore.row_attention``: dequantize, QJL-corrected scores, softmax), and its wiring as a GPU store.

The kernels' checks run when ``TRITON_INTERPRET=1`` was set before Triton was imported:
:func:`test_triton_kernel_under_the_interpreter` checks them in the session's interpreted run (tests/interpreted.py).
Rows are ragged and scattered over the pool (an empty one, one of a single token), read through ``req_to_token``
rows given out of order, so every program's bounds and every split's merge are exercised.
"""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.contract import KVGeometry
from sgl_sparse.registry import create_method

HKV, D, LAYERS, SLOTS, ROWS, WIDTH = 2, 16, 2, 160, 5, 64
SCALE = 1 / math.sqrt(D)
LENS = {3: 27, 0: 5, 4: 0, 1: 40, 2: 1}  # req_pool_idx -> cached tokens
NEW = [3, 0, 2, 1, 4]  # an extend step's new tokens per request (one with none, one over an empty prefix)
GRID = [(bits, qjl) for bits in (2, 3, 4) for qjl in (False, True)]


def _filled(bits: int, qjl: bool, group: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0, d: int = D):
    """A store with layer 1 holding ``LENS`` rows at random slots (slot 0, SGLang's padding slot, unused)."""
    store = create_method("turboquant", {"bits": bits, "qjl": qjl, "seed": 3}).store
    store.allocate(
        KVGeometry(
            num_layers=LAYERS,
            num_q_heads=HKV * group,
            num_kv_heads=HKV,
            head_dim=d,
            page_size=1,
            num_slots=SLOTS,
            dtype=dtype,
            device=torch.device("cpu"),
        )
    )
    gen = torch.Generator().manual_seed(seed * 10 + bits)
    free = torch.randperm(SLOTS - 1, generator=gen) + 1
    r2t = torch.zeros(ROWS, WIDTH, dtype=torch.int32)
    at = 0
    for row, n in LENS.items():
        slots = free[at : at + n]
        at += n
        k = torch.randn(n, HKV, d, generator=gen) * torch.linspace(0.2, 3, d)  # uneven channels: the rotation evens
        v = torch.randn(n, HKV, d, generator=gen)
        store.write(1, slots, k.to(dtype), v.to(dtype), torch.full((n,), row), decode=False)
        r2t[row, :n] = slots.to(torch.int32)
    return store, r2t, gen


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(list(LENS), dtype=torch.int32), torch.tensor(list(LENS.values()), dtype=torch.int32)


def test_the_store_declares_kernels_and_uses_them_on_cuda_only() -> None:
    for qjl in (False, True):
        store, _, _ = _filled(4, qjl)
        assert type(store).gpu_kernels and not store.use_triton  # CPU: the torch path
        layer = store.layer(1)
        assert layer.k_codes is store.k_codes[1] and layer.rot is store.rot
        assert (layer.proj is not None) == qjl and (layer.k_signs is not None) == qjl


@pytest.mark.skipif(INTERPRETED, reason="the launcher needs no kernel")
def test_the_launcher_starts_it_on_cuda() -> None:
    from sgl_sparse.integration.launch import parse_args
    from sgl_sparse.integration.plugin import register

    register()
    argv = ["--model-path", "m", "--device", "cuda", "--sparse-method", "turboquant"]
    _, hand = parse_args([*argv, "--sparse-config", '{"bits": 2, "qjl": true}'])
    assert hand.method == "turboquant" and hand.prefill_cuda_graph_off


@pytest.mark.parametrize(("bits", "qjl"), GRID)
def test_decode_kernel_equals_the_store_reference(bits: int, qjl: bool) -> None:
    """Over rows of 27, 5, 0, 40 and 1 tokens, 3 splits (some empty), group of 2 query heads per KV head."""
    if not INTERPRETED:
        pytest.skip("the kernel runs in the interpreted run")
    from sgl_sparse.kernels import turboquant_attention

    store, r2t, gen = _filled(bits, qjl)
    rpi, seq = _rows()
    q = torch.randn(len(LENS), HKV * 2, D, generator=gen)
    want = store.decode(1, q, r2t, rpi.long(), seq.long(), SCALE)
    got = turboquant_attention.decode_attention(q, store.layer(1), r2t, rpi, seq, SCALE, splits=3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # the empty row


@pytest.mark.parametrize(("bits", "qjl"), GRID)
def test_prefix_kernel_equals_the_store_reference(bits: int, qjl: bool) -> None:
    """New tokens over cached prefixes of 27, 5, 0, 40 and 1 tokens (a request with no new token, one with no
    prefix: ``-inf`` log-sum-exp and 0 output), blocks of 4 new tokens."""
    if not INTERPRETED:
        pytest.skip("the kernel runs in the interpreted run")
    from sgl_sparse.kernels import fp8_attention, turboquant_attention

    store, r2t, gen = _filled(bits, qjl, seed=1)
    rpi, lens = _rows()
    qo = torch.tensor([0, *torch.tensor(NEW).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(NEW), HKV * 2, D, generator=gen)
    want, want_lse = store.prefix(1, q, qo, r2t, rpi.long(), lens.long(), NEW, SCALE)
    bm = fp8_attention.prefix_block_m(2, False, 4)
    # One workspace pass with the step's blocks, and passes of at most 32 prefix tokens (27 | 5 | 40 | 1).
    for kw in ({"blocks": fp8_attention.prefix_blocks(NEW, bm, q.device)}, {"ws_tokens": 32}):
        got, got_lse = turboquant_attention.prefix_attention(
            q, store.layer(1), qo, r2t, rpi, lens, SCALE, NEW, bm, block_n=16, **kw
        )
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)
        assert torch.isinf(got_lse[3:5]).all() and not got[3:5].any()  # request 2's new tokens: no prefix


@pytest.mark.parametrize(("bits", "qjl", "d"), [(4, False, 64), (2, True, 128)])
def test_kernels_at_head_dims_whose_chunks_take_tl_dot(bits: int, qjl: bool, d: int) -> None:
    """At ``D = 16`` every chunk is under 16 channels (the logits' broadcast path); here 4-bit chunks of 32 channels
    (``D = 64``) and 2-bit chunks of 32 with QJL's 1-bit chunks of 16 (``D = 128``) take ``tl.dot``, as at serving
    shapes: decode and extend against the store's torch path."""
    if not INTERPRETED:
        pytest.skip("the kernel runs in the interpreted run")
    from sgl_sparse.kernels import fp8_attention, turboquant_attention

    store, r2t, gen = _filled(bits, qjl, seed=3, d=d)
    assert store.k_codes[1].shape[2] == d * bits // 8 and (not qjl or store.k_signs[1].shape[2] == d // 8)
    rpi, seq = _rows()
    scale = 1 / math.sqrt(d)
    q = torch.randn(len(LENS), HKV * 2, d, generator=gen)
    want = store.decode(1, q, r2t, rpi.long(), seq.long(), scale)
    got = turboquant_attention.decode_attention(q, store.layer(1), r2t, rpi, seq, scale, splits=3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    qo = torch.tensor([0, *torch.tensor(NEW).cumsum(0).tolist()], dtype=torch.int32)
    qe = torch.randn(sum(NEW), HKV * 2, d, generator=gen)
    want_o, want_lse = store.prefix(1, qe, qo, r2t, rpi.long(), seq.long(), NEW, scale)
    bm = fp8_attention.prefix_block_m(2, False, 4)
    got_o, got_lse = turboquant_attention.prefix_attention(qe, store.layer(1), qo, r2t, rpi, seq, scale, NEW, bm,
                                                           block_n=16)
    torch.testing.assert_close(got_o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group", [1, 3])
def test_kernels_through_the_store_at_other_groups_and_in_bf16(group: int) -> None:
    """The store's own kernel path (``use_triton``, as on CUDA: 16 splits, its extend blocks) at a group of 1 and
    of 3 query heads (not a power of two: masked tile rows), a bf16 model: the kernels decode in fp32 where the
    torch path rounds each dequantized key and value to bf16, so they agree to bf16's precision."""
    if not INTERPRETED:
        pytest.skip("the kernel runs in the interpreted run")
    store, r2t, gen = _filled(3, True, group=group, dtype=torch.bfloat16, seed=2)
    rpi, seq = _rows()
    q = torch.randn(len(LENS), HKV * group, D, generator=gen).to(torch.bfloat16)
    qo = torch.tensor([0, *torch.tensor(NEW).cumsum(0).tolist()], dtype=torch.int32)
    qe = torch.randn(sum(NEW), HKV * group, D, generator=gen).to(torch.bfloat16)
    want = store.decode(1, q, r2t, rpi.long(), seq.long(), SCALE)
    want_o, want_lse = store.prefix(1, qe, qo, r2t, rpi.long(), seq.long(), NEW, SCALE)
    store.use_triton = True
    got = store.decode(1, q, r2t, rpi, seq, SCALE)
    got_o, got_lse = store.prefix(1, qe, qo, r2t, rpi, seq, NEW, SCALE)
    assert got.dtype == got_o.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_o.float(), want_o.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_lse, want_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_triton_kernel_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
