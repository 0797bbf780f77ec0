"""KV quantization codecs in plain torch: the reference the quantization family's kernels will be tested against.

Not served yet (the method-owned KV pool of the quantization issue is not built); these functions fix
the formats and their math, and are the CPU path's quantize/dequantize:

* **FP8** (:func:`fp8_quantize`): E4M3 with one dynamic scale per (token, head), ``amax / 448``:
  SGLang 0.5.17's own FP8 KV has one scale per tensor, which clips outlier heads.
* **Asymmetric integer groups** (:func:`asym_quantize`, KIVI's building block): ``bits``-bit codes with
  a scale and zero point per group along one dimension. KIVI quantizes keys per channel (the group is
  ``group_size`` consecutive tokens of one channel: outliers live in fixed channels) and values per
  token (the group is ``group_size`` consecutive channels of one token): :func:`kivi_keys`,
  :func:`kivi_values`.
* **TurboQuant** (:func:`turboquant_quantize`): a seeded random rotation makes each coordinate of a unit
  vector ~ N(0, 1/D); a Lloyd-Max codebook for N(0, 1) (:func:`lloyd_max_gaussian`) then quantizes each
  coordinate at ``bits`` bits, and the vector's norm is kept in fp32. The optional 1-bit QJL residual
  (:func:`qjl_encode`, :func:`qjl_inner`) makes inner products with the key unbiased.
* **Chunk-major packing** (:func:`pack_chunks`): ``P = 8 / lane`` codes a byte, ``W = D / P`` bytes a
  vector; byte ``j`` holds in bits ``[c * lane, (c + 1) * lane)`` the code of channel ``c * W + j``. So one
  shift and mask over a vector's ``W`` bytes is the contiguous channel chunk ``[c * W, (c + 1) * W)``: a
  kernel reads the bytes once and decodes chunk ``c`` with ~2 integer ops an element, no reshape. Lanes are
  1, 2 or 4 bits (:func:`lane_bits`): 3-bit codes take a 4-bit lane (a third more bytes than 3 bits
  packed), which the stores' declared sizes count.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 1e-12


# -- FP8, per-token per-head scales -----------------------------------------------------------------
def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` -> (``float8_e4m3fn`` codes ``[..., D]``, fp32 scales ``[...]``)."""
    scale = x.abs().amax(dim=-1).to(torch.float32).clamp(min=_TINY) / FP8_MAX
    codes = (x.to(torch.float32) / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (codes.to(torch.float32) * scale[..., None]).to(dtype)


# -- asymmetric integer groups (KIVI) ---------------------------------------------------------------
def asym_quantize(x: torch.Tensor, bits: int, dim: int,
                  stored: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group per slice along ``dim``: (uint8 codes like ``x``, fp32 scale and zero with ``dim``
    reduced to 1). ``x ~ codes * scale + zero``; a constant group gets scale 0 and decodes exactly.
    ``stored``: the dtype a store keeps the scale and zero in; the codes are then taken against them as rounded to
    it (what is read back), and they are returned in it."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    xf = x.to(torch.float32)
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    # A 0-dim device tensor, not a Python number: CUDA's division by a CPU scalar multiplies by its reciprocal,
    # one ulp off IEEE division at times, which flips a code at a near-tie against KIVI's decode-write kernel
    # (kernels/kivi_write.py divides exactly); tests/gpu/test_gpu_kivi.py catches it.
    scale = (hi - lo) / hi.new_full((), 2**bits - 1)
    if stored is not None:
        scale, lo = scale.to(stored), lo.to(stored)
    step = scale.float()
    codes = torch.round((xf - lo.float()) / torch.where(step > 0, step, torch.ones_like(step)))
    return codes.clamp(0, 2**bits - 1).to(torch.uint8), scale, lo


def asym_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (codes.to(torch.float32) * scale + zero).to(dtype)


def kivi_keys(k: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``[N, H, D]`` (``N`` a multiple of ``group_size``) per channel over groups of tokens: codes
    ``[N, H, D]``, scale and zero ``[N / group_size, H, D]``."""
    n, h, d = k.shape
    if n % group_size:
        raise ValueError(f"{n} tokens are not whole groups of {group_size} (the recent ones stay unquantized)")
    codes, scale, zero = asym_quantize(k.reshape(n // group_size, group_size, h, d), bits, dim=1)
    return codes.reshape(n, h, d), scale[:, 0], zero[:, 0]


def kivi_keys_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    n, h, d = codes.shape
    g = n // scale.shape[0]
    return asym_dequantize(codes.view(-1, g, h, d), scale[:, None], zero[:, None], dtype).reshape(n, h, d)


def kivi_values(v: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``[N, H, D]`` per token over groups of ``group_size`` channels: codes ``[N, H, D]``,
    scale and zero ``[N, H, D / group_size]``."""
    n, h, d = v.shape
    if d % group_size:
        raise ValueError(f"head_dim {d} is not a multiple of group_size {group_size}")
    codes, scale, zero = asym_quantize(v.reshape(n, h, d // group_size, group_size), bits, dim=3)
    return codes.reshape(n, h, d), scale[..., 0], zero[..., 0]


def kivi_values_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    n, h, d = codes.shape
    g = d // scale.shape[-1]
    return asym_dequantize(codes.view(n, h, -1, g), scale[..., None], zero[..., None], dtype).reshape(n, h, d)


# -- TurboQuant -------------------------------------------------------------------------------------
def rotation(d: int, seed: int) -> torch.Tensor:
    """A seeded random orthogonal ``[d, d]`` fp32 matrix (QR of a Gaussian, signs fixed so the draw is
    uniform over the orthogonal group)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).to(torch.float32)


def lloyd_max_gaussian(bits: int, iters: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """The MSE-optimal ``2**bits``-level quantizer of N(0, 1): (levels ``[2**bits]``, the ``2**bits - 1``
    decision boundaries between them), fp32, ascending. Lloyd's iteration with exact conditional means
    ``E[X | a < X < b] = (phi(a) - phi(b)) / (Phi(b) - Phi(a))``."""
    n = 2**bits
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    levels = normal.icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    for _ in range(iters):
        edges = torch.cat([torch.tensor([-math.inf]), (levels[1:] + levels[:-1]) / 2, torch.tensor([math.inf])])
        pdf = torch.exp(normal.log_prob(edges))
        mass = normal.cdf(edges[1:]) - normal.cdf(edges[:-1])
        levels = (pdf[:-1] - pdf[1:]) / mass
    return levels.to(torch.float32), ((levels[1:] + levels[:-1]) / 2).to(torch.float32)


def turboquant_quantize(x: torch.Tensor, rot: torch.Tensor,
                        boundaries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` -> (uint8 codes ``[..., D]`` of the rotated, unit-norm, sqrt(D)-scaled vector;
    fp32 norms ``[...]``)."""
    d = x.shape[-1]
    xf = x.to(torch.float32)
    norm = xf.norm(dim=-1)
    y = (xf / norm.clamp(min=_TINY)[..., None]) @ rot.T * math.sqrt(d)
    return torch.bucketize(y, boundaries.to(y.device)).to(torch.uint8), norm


def turboquant_dequantize(codes: torch.Tensor, norm: torch.Tensor, rot: torch.Tensor, levels: torch.Tensor,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    d = codes.shape[-1]
    y = levels.to(codes.device)[codes.long()] / math.sqrt(d)
    return ((y @ rot) * norm[..., None]).to(dtype)


def qjl_encode(residual: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit QJL of a residual ``[..., D]`` under a Gaussian ``proj`` ``[M, D]``: (signs of ``proj @ r``
    as bool ``[..., M]``, fp32 ``||r||`` ``[...]``)."""
    r = residual.to(torch.float32)
    return (r @ proj.T) >= 0, r.norm(dim=-1)


def qjl_inner(q: torch.Tensor, signs: torch.Tensor, rnorm: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """Unbiased estimate of ``<q, r>`` (``q`` ``[..., D]``, broadcast against the codes):
    ``sqrt(pi / 2) / M * ||r|| * <proj @ q, sign(proj @ r)>``, since ``E[g sign(g . r)] = sqrt(2 / pi) r / ||r||``
    for a standard Gaussian row ``g``."""
    m = proj.shape[0]
    s = signs.to(torch.float32) * 2 - 1
    return math.sqrt(math.pi / 2) / m * rnorm * ((q.to(torch.float32) @ proj.T) * s).sum(dim=-1)


# -- chunk-major packing ----------------------------------------------------------------------------
def lane_bits(bits: int) -> int:
    """The bits a ``bits``-bit code takes in :func:`pack_chunks`'s layout: 1, 2 or 4 (3-bit codes a 4-bit lane)."""
    if not 1 <= bits <= 4:
        raise ValueError(f"bits must be in 1..4, got {bits}")
    return 4 if bits == 3 else bits


def pack_chunks(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (values < ``2**bits``) -> uint8 ``[..., W]``, ``W = D / P`` with ``P = 8 / lane``
    codes a byte (``lane = lane_bits(bits)``): byte ``j`` holds the code of channel ``c * W + j`` in its bits
    ``[c * lane, (c + 1) * lane)``, so ``(byte >> c * lane) & mask`` over the ``W`` bytes is channels
    ``[c * W, (c + 1) * W)``."""
    lane = lane_bits(bits)
    p = 8 // lane
    d = codes.shape[-1]
    if d % p:
        raise ValueError(f"the last dimension ({d}) must be a multiple of {p} ({bits}-bit codes, {p} a byte)")
    c = codes.to(torch.int32).view(*codes.shape[:-1], p, d // p)
    shifts = torch.arange(p, device=codes.device, dtype=torch.int32)[:, None] * lane
    return (c << shifts).sum(dim=-2).to(torch.uint8)


def unpack_chunks(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_chunks`: uint8 ``[..., W]`` -> codes ``[..., P * W]``."""
    lane = lane_bits(bits)
    p = 8 // lane
    shifts = torch.arange(p, device=packed.device, dtype=torch.int32)[:, None] * lane
    chunks = (packed.to(torch.int32)[..., None, :] >> shifts) & ((1 << lane) - 1)  # [..., P, W]
    return chunks.flatten(-2).to(torch.uint8)
