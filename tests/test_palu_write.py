"""Palu's write kernel (``kernels/palu_write.py``) against Palu's write from its definition, written here in plain
torch (float64: pairs of each head rotated back by the table's angles, projected onto the group's basis), under the
Triton interpreter: :func:`test_palu_write_under_the_interpreter` checks them in the session's interpreted run
(tests/interpreted.py). Both rotary layouts, fp32 and bf16 pools, groups of one and two heads, ranks that are not
powers of two and a rank of the group's whole ``g * D``, K and V as strided views, random positions, and slots
scattered over a larger pool whose other slots must stay as they were."""

from __future__ import annotations

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

MAX_POS = 4096
SLOTS = 160


def _table(d: int, base: float = 10_000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=-1).float()


def _basis(groups: int, gd: int, r: int, gen: torch.Generator) -> torch.Tensor:
    """Orthonormal columns, as Palu's are: latents of the keys' own size."""
    q = torch.linalg.qr(torch.randn(groups, gd, r, generator=gen, dtype=torch.float64)).Q
    return q.float().contiguous()


def _reference(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
               table: torch.Tensor, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents in float64: pair ``(a, b)`` of each head turned back by its angle (``a cos + b sin``,
    ``b cos - a sin``), then ``z = x^T B`` per group."""
    n, hkv, d = k.shape
    half = d // 2
    cs = table[positions].double()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = k.double()
    a_idx = torch.arange(half) if neox else torch.arange(0, d, 2)
    b_idx = a_idx + half if neox else a_idx + 1
    a, b = x[..., a_idx], x[..., b_idx]
    pre = torch.empty_like(x)
    pre[..., a_idx] = a * cos + b * sin
    pre[..., b_idx] = b * cos - a * sin
    groups = kb.shape[0]
    zk = torch.einsum("ngd,gdr->ngr", pre.reshape(n, groups, -1), kb.double())
    zv = torch.einsum("ngd,gdr->ngr", v.double().reshape(n, groups, -1), vb.double())
    return zk, zv


def assert_within_one_ulp(got: torch.Tensor, want64: torch.Tensor) -> None:
    """``got`` (bf16) against the float64 truth: each value at most one bf16 unit in the last place from the truth
    rounded to bf16. The kernel rounds an fp32 sum whose order differs from any reference's, so where the truth lies
    within fp32 rounding of a bf16 rounding boundary the two round to neighbours; nearly all agree exactly."""
    want = want64.to(torch.float32).to(torch.bfloat16).float()
    g = got.float()
    mag = torch.maximum(g.abs(), want.abs())
    ulp = torch.ldexp(torch.ones_like(mag), torch.frexp(mag).exponent - 8)  # bf16: 8 significant bits
    assert bool(((g - want).abs() <= ulp).all()), f"max error {(g - want).abs().max()} over one bf16 ulp"
    exact = (g == want).float().mean().item()
    assert exact > 0.99, f"only {exact:.4f} of the latents equal the reference rounded to bf16"


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
@pytest.mark.parametrize(("neox", "dtype", "hkv", "gs", "d", "rk", "rv", "chunk"), [
    (True, torch.float32, 2, 1, 32, 24, 16, 32),
    (False, torch.bfloat16, 4, 2, 32, 48, 64, 32),  # rank g * D for V
    (False, torch.float32, 2, 2, 32, 64, 24, 32),  # rank g * D for K
    (True, torch.bfloat16, 2, 1, 64, 64, 48, 16),  # two rotation chunks a head, rank D
])
def test_write_matches_the_definition(neox: bool, dtype: torch.dtype, hkv: int, gs: int, d: int, rk: int, rv: int,
                                      chunk: int) -> None:
    from sgl_sparse.kernels.palu_write import write_latents

    gen = torch.Generator().manual_seed(hkv * 100 + d + rk)
    n, groups = 37, hkv // gs  # 37: three token blocks, the last part-filled
    table = _table(d)
    kb, vb = _basis(groups, gs * d, rk, gen), _basis(groups, gs * d, rv, gen)
    # K and V as the model hands them: views into one wider row per token (the last dim contiguous)
    kv = torch.randn(n, 2 * hkv + 1, d, generator=gen).to(dtype)
    k, v = kv[:, :hkv], kv[:, hkv + 1:]
    positions = torch.randint(0, MAX_POS, (n,), generator=gen)
    loc = torch.randperm(SLOTS - 1, generator=gen)[:n] + 1
    # pools filled with what the write must leave alone
    zk0 = torch.randn(SLOTS, groups, rk, generator=gen).to(dtype)
    zv0 = torch.randn(SLOTS, groups, rv, generator=gen).to(dtype)
    pos0 = torch.randint(0, 100, (SLOTS,), generator=gen, dtype=torch.int32)
    zk, zv, pos = zk0.clone(), zv0.clone(), pos0.clone()
    write_latents(k, v, positions, loc.to(torch.int32) if neox else loc, zk, zv, pos, kb, vb, table, neox,
                  chunk=chunk)
    want_k, want_v = _reference(k, v, positions, kb, vb, table, neox)
    if dtype == torch.float32:
        torch.testing.assert_close(zk[loc], want_k.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(zv[loc], want_v.float(), rtol=1e-5, atol=1e-5)
    else:
        assert_within_one_ulp(zk[loc], want_k)
        assert_within_one_ulp(zv[loc], want_v)
    assert pos.dtype == torch.int32 and torch.equal(pos[loc], positions.to(torch.int32))
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(zk[untouched], zk0[untouched]) and torch.equal(zv[untouched], zv0[untouched])
    assert torch.equal(pos[untouched], pos0[untouched])
    # no tokens: nothing written, nothing launched
    write_latents(k[:0], v[:0], positions[:0], loc[:0], zk, zv, pos, kb, vb, table, neox)
    assert torch.equal(zk[untouched], zk0[untouched])
    # slot 0, SGLang's padding slot (a CUDA graph's padded rows write there): never written
    pad = loc.clone()
    pad[::2] = 0
    write_latents(k, v, positions, pad.to(loc.dtype), zk, zv, pos, kb, vb, table, neox, chunk=chunk)
    assert torch.equal(zk[0], zk0[0]) and torch.equal(zv[0], zv0[0]) and int(pos[0]) == int(pos0[0])


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_palu_write_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
