"""The split-KV decode's merge (``kernels/splits.py::merge_splits``, one Triton kernel) against the merge written
here in plain torch, under the Triton interpreter: splits that read nothing, a row that read nothing, a split
count that is not a power of two, the output in fp32 and bf16, and the two bases the stores map the merged
state through (TurboQuant's shared rotation, given transposed; Palu's value basis per group of KV heads, of a
rank below the state's padded width)."""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import INTERPRETED, assert_interpreted_passed

from sgl_sparse.kernels.splits import merge_splits

BATCH, HKV, G = 3, 4, 2


def _states(splits: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random split states ``[BATCH * HKV, splits, G(, width)]``: a third of the splits read nothing (max
    ``-inf``, denominator and output 0), and so does every split of the last row."""
    gen = torch.Generator().manual_seed(seed)
    rows = BATCH * HKV
    m = torch.randn(rows, splits, G, generator=gen) * 3
    den = torch.rand(rows, splits, G, generator=gen) * 5 + 0.1
    acc = torch.randn(rows, splits, G, width, generator=gen)
    empty = torch.rand(rows, splits, 1, generator=gen) < 1 / 3
    empty[-1] = True
    m = m.masked_fill(empty, float("-inf"))
    return m, den.masked_fill(empty, 0.0), acc.masked_fill(empty[..., None], 0.0)


def _merged(m: torch.Tensor, den: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """``[rows, G, width]``: each split weighed by ``exp(m - max over the splits)``, normalized; zeros where no
    split read anything."""
    out = torch.zeros(acc.shape[0], acc.shape[2], acc.shape[3])
    for row in range(acc.shape[0]):
        for g in range(acc.shape[2]):
            live = m[row, :, g] > float("-inf")
            if not live.any():
                continue
            w = torch.exp(m[row, live, g] - m[row, live, g].max())
            out[row, g] = (w[:, None] * acc[row, live, g]).sum(0) / (w * den[row, live, g]).sum()
    return out


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
@pytest.mark.parametrize("splits", [16, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_matches_torch(splits: int, dtype: torch.dtype) -> None:
    m, den, acc = _states(splits, 16, seed=splits)
    got = merge_splits(m, den, acc, BATCH, dtype)
    assert got.shape == (BATCH, HKV * G, 16) and got.dtype == dtype
    want = _merged(m, den, acc).view(BATCH, HKV * G, 16)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got[-1, -G:], torch.zeros(G, 16, dtype=dtype))  # the row that read nothing


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
def test_merge_weighs_empty_splits_zero() -> None:
    """By hand: splits (max 1, den 2, acc [2, 4]), empty, (0.5, 1, [1, 1]); and a row of empty splits."""
    m = torch.tensor([[[1.0], [float("-inf")], [0.5]], [[float("-inf")]] * 3])
    den = torch.tensor([[[2.0], [0.0], [1.0]], [[0.0]] * 3])
    acc = torch.tensor([[[[2.0, 4.0]], [[0.0, 0.0]], [[1.0, 1.0]]], [[[0.0, 0.0]]] * 3])
    out = merge_splits(m, den, acc, 2, torch.float32)
    w = torch.tensor([1.0, math.exp(-0.5)])
    want = (w[0] * torch.tensor([2.0, 4.0]) + w[1] * torch.tensor([1.0, 1.0])) / (2 * w[0] + w[1])
    torch.testing.assert_close(out[0, 0], want)
    assert torch.equal(out[1], torch.zeros(1, 2))


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
def test_merge_through_a_shared_rotation() -> None:
    """TurboQuant's output is the merged state times its rotation ``[D, D]``: passed as the transposed view."""
    m, den, acc = _states(16, 32, seed=1)
    rot = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(2))).Q
    got = merge_splits(m, den, acc, BATCH, torch.float32, basis=rot.T)
    want = (_merged(m, den, acc) @ rot).view(BATCH, HKV * G, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="the kernel runs in the interpreted run")
@pytest.mark.parametrize("heads", [1, 2])
def test_merge_through_a_value_basis_per_group(heads: int) -> None:
    """Palu: a group of ``heads`` KV heads shares a basis ``[heads * D, r]``; the merged state is ``r`` = 24
    latent values padded to 32, each head's output ``D`` = 16 rows of its group's basis times them."""
    d, r = 16, 24
    m, den, acc = _states(16, 32, seed=3)
    acc[..., r:] = 7.0  # padding the kernel must not read
    basis = torch.randn(HKV // heads, heads * d, r, generator=torch.Generator().manual_seed(4))
    got = merge_splits(m, den, acc, BATCH, torch.float32, basis=basis, basis_heads=heads)
    lat = _merged(m, den, acc)[..., :r].view(BATCH, HKV // heads, heads, G, r)
    want = torch.einsum("bxsgr,xsdr->bxsgd", lat, basis.view(HKV // heads, heads, d, r))
    torch.testing.assert_close(got, want.reshape(BATCH, HKV * G, d), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_split_merge_under_the_interpreter() -> None:
    assert_interpreted_passed(__file__)
