"""TurboQuant's layout (sgl_sparse/methods/quantization/turboquant.py) against its codec applied by hand here
(``kernels/quant.py``, whose distortion and QJL unbiasedness tests/test_quant_codecs.py checks)."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse.contract import KVGeometry
from sgl_sparse.errors import SparseConfigError
from sgl_sparse.kernels import quant
from sgl_sparse.registry import create_method
from sgl_sparse.store_reads import attend

HKV, G, D, LAYERS, SLOTS = 2, 2, 16, 2, 64
SCALE = 1 / math.sqrt(D)


def _store(bits: int, qjl: bool = False):
    store = create_method("turboquant", {"bits": bits, "qjl": qjl}).store
    store.allocate(KVGeometry(num_layers=LAYERS, num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, page_size=1,
                              num_slots=SLOTS, dtype=torch.float32, device=torch.device("cpu")))
    return store


def test_config_and_sizes() -> None:
    with pytest.raises(SparseConfigError, match="bits"):
        create_method("turboquant", {"bits": 5})
    for bits in (2, 3, 4):
        for qjl in (False, True):
            store = _store(bits, qjl)
            taken = sum(t.numel() * t.element_size() for i in range(LAYERS) for t in store.slot_tensors(i))
            g = KVGeometry(num_layers=LAYERS, num_q_heads=HKV * G, num_kv_heads=HKV, head_dim=D, page_size=1,
                           num_slots=SLOTS, dtype=torch.float32, device=torch.device("cpu"))
            assert taken == store.bytes_per_token(g) * SLOTS
    # 3-bit codes are stored in 4-bit lanes (chunk-major packing): 3 bits cost 4 bits' bytes, and say so
    assert _store(3).bytes_per_token(g) == _store(4).bytes_per_token(g) == LAYERS * 2 * HKV * (D // 2 + 4)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_write_read_and_decode_are_the_codec(bits: int) -> None:
    store = _store(bits)
    gen = torch.Generator().manual_seed(bits)
    k, v = torch.randn(30, HKV, D, generator=gen) * 3, torch.randn(30, HKV, D, generator=gen)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:30] + 1
    store.write(1, slots, k, v, torch.zeros(30, dtype=torch.long), decode=False)
    rot = quant.rotation(D, 0)
    levels, bounds = quant.lloyd_max_gaussian(bits)
    want_k = quant.turboquant_dequantize(*quant.turboquant_quantize(k, rot, bounds), rot, levels, torch.float32)
    got_k, got_v = store.read(1, slots)
    torch.testing.assert_close(got_k, want_k)
    assert ((got_v - v).norm(dim=-1) / v.norm(dim=-1)).mean() < {2: 0.4, 3: 0.2, 4: 0.12}[bits]
    r2t = torch.zeros(2, 40, dtype=torch.int32)
    r2t[1, :30] = slots.to(torch.int32)
    q = torch.randn(1, HKV * G, D, generator=gen)
    out = store.decode(1, q, r2t, torch.tensor([1]), torch.tensor([30]), SCALE)
    torch.testing.assert_close(out[0], attend(q, got_k, got_v, SCALE)[0][0], atol=1e-5, rtol=1e-5)


def test_qjl_scores_add_the_residual_estimate() -> None:
    """With QJL, each logit is the MSE reconstruction's plus ``qjl_inner`` of the key's residual (that estimate
    is unbiased: tests/test_quant_codecs.py)."""
    store = _store(2, qjl=True)
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(12, HKV, D, generator=gen), torch.randn(12, HKV, D, generator=gen)
    slots = torch.arange(1, 13)
    store.write(0, slots, k, v, torch.zeros(12, dtype=torch.long), decode=False)
    q = torch.randn(3, HKV * G, D, generator=gen)
    got = store._scores(0, q, slots, 1.0)  # [Hq, 3, 12]
    kh, _ = store.read(0, slots)
    for h in range(HKV * G):
        kv = h // G
        for t in range(3):
            for s in range(12):
                residual = k[s, kv] - kh[s, kv]
                signs, rnorm = quant.qjl_encode(residual, store.proj)
                want = q[t, h] @ kh[s, kv] + quant.qjl_inner(q[t, h], signs, rnorm, store.proj)
                assert abs(got[h, t, s].item() - want.item()) < 1e-3
