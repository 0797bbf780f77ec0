"""The quantization codecs (sgl_sparse/kernels/quant.py) against their published math."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_sparse.kernels import quant


def test_fp8_per_head_scales_keep_a_small_head_exact_beside_an_outlier_head() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 2, 128)
    x[:, 1] *= 1e5  # an outlier head, past E4M3's 18 binades
    codes, scale = quant.fp8_quantize(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64, 2)
    err = (quant.fp8_dequantize(codes, scale, torch.float32) - x).abs()
    # E4M3: 3 mantissa bits, so at most half a step (1/16 of the value), or half the subnormal step 2^-9
    assert (err <= x.abs() / 16 + scale[..., None] * 2.0**-10).all()
    # one scale for the whole tensor (SGLang's FP8 KV) loses the small head's values near zero
    whole = x.abs().amax() / quant.FP8_MAX
    per_tensor = ((x / whole).to(torch.float8_e4m3fn).to(torch.float32) * whole - x)[:, 0].abs().mean()
    assert err[:, 0].mean() < per_tensor / 10


def test_asym_groups_round_to_half_a_step_and_a_constant_group_is_exact() -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 4, 32)
    x[3] = 0.25
    for bits in (2, 4):
        codes, scale, zero = quant.asym_quantize(x, bits, dim=2)
        assert codes.max() <= 2**bits - 1 and scale.shape == (8, 4, 1)
        back = quant.asym_dequantize(codes, scale, zero, torch.float32)
        assert ((back - x).abs() <= scale / 2 + 1e-6).all()
        assert torch.equal(back[3], x[3])
    with pytest.raises(ValueError, match="bits"):
        quant.asym_quantize(x, 9, dim=0)


def test_kivi_keys_per_channel_beat_per_token_on_outlier_channels() -> None:
    torch.manual_seed(2)
    k = torch.randn(64, 2, 128)
    k[..., 7] = 40.0 + torch.randn(64, 2)  # a fixed outlier channel, as KIVI observes in keys
    codes, scale, zero = quant.kivi_keys(k, bits=2, group_size=32)
    assert codes.shape == k.shape and scale.shape == (2, 2, 128)
    per_channel = (quant.kivi_keys_dequantize(codes, scale, zero, torch.float32) - k).pow(2).mean()
    vc, vs, vz = quant.kivi_values(k, bits=2, group_size=32)  # the same keys quantized per token
    per_token = (quant.kivi_values_dequantize(vc, vs, vz, torch.float32) - k).pow(2).mean()
    assert per_channel < per_token / 4
    v = torch.randn(5, 2, 128)
    vc, vs, vz = quant.kivi_values(v, bits=4, group_size=32)
    assert vs.shape == (5, 2, 4)
    back = quant.kivi_values_dequantize(vc, vs, vz, torch.float32)
    assert ((back - v).abs() <= vs.repeat_interleave(32, -1) / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="whole groups"):
        quant.kivi_keys(k[:40], bits=2, group_size=32)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quant.kivi_values(v[..., :48], bits=2, group_size=32)


def test_lloyd_max_levels_are_the_published_gaussian_quantizers() -> None:
    lv1, _ = quant.lloyd_max_gaussian(1)
    assert torch.allclose(lv1, torch.tensor([-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)]), atol=1e-4)
    lv2, b2 = quant.lloyd_max_gaussian(2)  # Max (1960): +-0.4528, +-1.510; boundary 0.9816
    assert torch.allclose(lv2, torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104]), atol=1e-3)
    assert torch.allclose(b2, torch.tensor([-0.9816, 0.0, 0.9816]), atol=1e-3)
    lv3, _ = quant.lloyd_max_gaussian(3)
    assert torch.allclose(lv3[4:], torch.tensor([0.2451, 0.7560, 1.3439, 2.1519]), atol=1e-3)


def test_turboquant_mse_matches_the_gaussian_quantizers_distortion() -> None:
    d = 128
    rot = quant.rotation(d, seed=0)
    assert torch.allclose(rot @ rot.T, torch.eye(d), atol=1e-5)
    torch.manual_seed(3)
    x = torch.randn(2000, d) * torch.rand(2000, 1) * 5
    # Lloyd-Max distortion of N(0, 1) (Max 1960): 0.1175 at 2 bits, 0.03454 at 3, 0.009497 at 4
    for bits, mse in ((2, 0.1175), (3, 0.03454), (4, 0.009497)):
        levels, bounds = quant.lloyd_max_gaussian(bits)
        codes, norm = quant.turboquant_quantize(x, rot, bounds)
        assert codes.max() < 2**bits
        back = quant.turboquant_dequantize(codes, norm, rot, levels, torch.float32)
        rel = ((back - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
        assert abs(rel - mse) < 0.15 * mse, (bits, rel)


def test_qjl_residual_makes_the_one_bit_inner_product_unbiased() -> None:
    d, draws = 64, 300
    torch.manual_seed(4)
    x = torch.randn(d)
    q = x + 0.5 * torch.randn(d)  # a query correlated with the key
    truth = (q @ x).item()
    levels, bounds = quant.lloyd_max_gaussian(1)
    plain, corrected = [], []
    for seed in range(draws):
        rot = quant.rotation(d, seed)
        codes, norm = quant.turboquant_quantize(x, rot, bounds)
        xh = quant.turboquant_dequantize(codes, norm, rot, levels, torch.float32)
        proj = torch.randn(d, d, generator=torch.Generator().manual_seed(10_000 + seed))
        signs, rnorm = quant.qjl_encode(x - xh, proj)
        plain.append((q @ xh).item())
        corrected.append((q @ xh).item() + quant.qjl_inner(q, signs, rnorm, proj).item())
    scale = (q.norm() * x.norm()).item()
    # the MSE quantizer alone shrinks inner products by 2/pi at one bit (TurboQuant, section 3.2)
    assert abs(sum(plain) / draws - 2 / math.pi * truth) < 0.03 * scale
    assert abs(sum(corrected) / draws - truth) < 0.03 * scale
    assert abs(sum(plain) / draws - truth) > 0.1 * scale


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_chunk_packing_round_trips_every_width(bits: int) -> None:
    torch.manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 2, 128), dtype=torch.uint8)
    lane = quant.lane_bits(bits)
    packed = quant.pack_chunks(codes, bits)
    assert packed.shape == (3, 2, 128 * lane // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_chunks(packed, bits), codes)
    assert packed.numel() * 8 == codes.numel() * lane  # 3-bit codes take 4-bit lanes
    with pytest.raises(ValueError, match="multiple of"):
        quant.pack_chunks(codes[..., :(8 // lane) * 3 - 1], bits)
    with pytest.raises(ValueError, match="bits"):
        quant.pack_chunks(codes, 5)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_chunk_c_of_a_byte_row_is_a_contiguous_channel_range(bits: int) -> None:
    """``(byte >> c * bits) & mask`` over a vector's ``W`` bytes is channels ``[c W, (c + 1) W)``, in order:
    what the kernels read as one ``[tokens, W]`` tile per chunk."""
    d, p = 64, 8 // bits
    w = d // p
    torch.manual_seed(10 + bits)
    codes = torch.randint(0, 2**bits, (5, d), dtype=torch.uint8)
    packed = quant.pack_chunks(codes, bits).to(torch.int32)
    assert packed.shape == (5, w)
    for c in range(p):
        assert torch.equal((packed >> (c * bits)) & (2**bits - 1), codes[:, c * w:(c + 1) * w].to(torch.int32))
    one = torch.zeros(1, d, dtype=torch.uint8)
    one[0, w + 3] = 1  # channel W + 3: chunk 1, byte 3
    assert quant.pack_chunks(one, bits)[0].tolist() == [0, 0, 0, 1 << bits] + [0] * (w - 4)
