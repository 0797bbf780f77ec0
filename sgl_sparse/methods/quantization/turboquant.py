"""TurboQuant (Zandieh et al., 2025, arXiv:2504.19874): a seeded random rotation, then a per-coordinate
Lloyd-Max (Gaussian) codebook, plus an optional 1-bit QJL residual that makes ``q . k`` unbiased.

A random orthogonal rotation makes every coordinate of a unit vector ~ N(0, 1/D), so one scalar codebook
(the MSE-optimal one for N(0, 1), ``kernels/quant.py::lloyd_max_gaussian``) serves every coordinate of
every token and head; per token and head only the norm is stored. With ``qjl``, the key's quantization
residual ``r`` is kept as ``sign(S r)`` (``S`` a seeded Gaussian ``D x D``) and ``||r||``, and attention
scores add QJL's unbiased estimate of ``q . r`` (SparseEngine's port has no QJL). Defaults: 4 bits (2
and 3 also), QJL off, seed 0.

Layout, per layer: K and V codes ``[slots, Hkv, D * lane / 8]`` uint8, chunk-major (``kernels/quant.py::
pack_chunks``: byte ``j`` holds channel ``c * W + j`` in its ``c``-th lane, ``W = D * lane / 8``), K and V norms
``[slots, Hkv]`` fp32; with QJL, the residual's signs ``[slots, Hkv, D / 8]`` (1-bit lanes) and norms ``[slots,
Hkv]``. The lane is the code's width at 2 and 4 bits; 3-bit codes take 4-bit lanes (a byte holds whole codes
only at 1, 2 and 4 bits), so 3 bits cost 4 bits' bytes for a coarser codebook. At 4 bits a
Llama-3-8B layer costs 1,088 bytes per token (3.76x bf16's tokens; QJL adds 160). Per-token, so no
residual and no page constraint. The torch path here serves the CPU server and is the kernels' reference;
on CUDA decode and extend are Triton kernels (``kernels/turboquant_attention.py``: queries rotated once,
keys and values read as codebook levels in the rotated basis, the output rotated back once), checked by
tests/gpu/test_gpu_turboquant.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import Family, KVGeometry, KVStore, SparseMethod
from sgl_sparse.kernels import fp8_attention, quant, turboquant_attention
from sgl_sparse.methods.quantization.base import QuantConfig
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class TurboQuantConfig(QuantConfig):
    """``bits`` per coordinate of keys and values (3 stored in 4-bit lanes: 4 bits' bytes); ``qjl`` adds the keys'
    1-bit residual; ``seed`` draws the rotation (and QJL's projection). ``prefix_attention`` as
    :class:`QuantConfig`'s; ``dequantize`` reads the MSE reconstruction, without ``qjl``'s residual term, which only
    the kernels add: refused with ``qjl``, where ``auto`` reads through the kernel."""

    method_name = "turboquant"
    bits: int = 4
    qjl: bool = False
    seed: int = 0

    def validate(self) -> None:
        self.require(self.bits in (2, 3, 4), "bits", "must be 2, 3 or 4")
        super().validate()
        self.require(not (self.qjl and self.prefix_attention == "dequantize"), "prefix_attention",
                     "'dequantize' reads the MSE reconstruction, without qjl's residual term: use 'auto' or "
                     "'kernel' with qjl")


class TurboQuantStore(KVStore):
    # Decode and extend run as Triton kernels on CUDA (kernels/turboquant_attention.py).
    gpu_kernels = True

    def __init__(self, config: TurboQuantConfig) -> None:
        self.bits = config.bits
        self.qjl = config.qjl
        self.seed = config.seed
        self.choose_prefix_attention(config.prefix_attention)
        if self.qjl:
            self.decline_dequantized_prefix("the dequantized keys lack qjl's residual term")
        self.dtype = torch.bfloat16
        self.use_triton = False
        self._blocks = fp8_attention.StepBlocks()

    def bytes_per_token(self, g: KVGeometry) -> int:
        per_layer = 2 * g.num_kv_heads * (g.head_dim * quant.lane_bits(self.bits) // 8 + 4)  # 3 bits: 4-bit lanes
        if self.qjl:
            per_layer += g.num_kv_heads * (g.head_dim // 8 + 4)
        return g.num_layers * per_layer

    def allocate(self, g: KVGeometry) -> None:
        if g.head_dim % 8:
            raise ValueError(f"turboquant: head_dim {g.head_dim} must be a multiple of 8")
        dev, h, d, n = g.device, g.num_kv_heads, g.head_dim, g.num_slots
        self.rot = quant.rotation(d, self.seed).to(dev)
        levels, bounds = quant.lloyd_max_gaussian(self.bits)
        self.levels, self.bounds = levels.to(dev), bounds.to(dev)
        self.unit_levels = self.levels / math.sqrt(d)  # the kernels' codebook: coordinates of a unit vector
        codes = (n, h, d * quant.lane_bits(self.bits) // 8)
        self.k_codes = [torch.zeros(codes, dtype=torch.uint8, device=dev) for _ in range(g.num_layers)]
        self.v_codes = [torch.zeros(codes, dtype=torch.uint8, device=dev) for _ in range(g.num_layers)]
        self.k_norm = [torch.zeros(n, h, dtype=torch.float32, device=dev) for _ in range(g.num_layers)]
        self.v_norm = [torch.zeros(n, h, dtype=torch.float32, device=dev) for _ in range(g.num_layers)]
        if self.qjl:
            gen = torch.Generator().manual_seed(self.seed + 1)
            self.proj = torch.randn(d, d, generator=gen).to(dev)
            self.k_signs = [torch.zeros(n, h, d // 8, dtype=torch.uint8, device=dev) for _ in range(g.num_layers)]
            self.k_rnorm = [torch.zeros(n, h, dtype=torch.float32, device=dev) for _ in range(g.num_layers)]
        self.dtype = g.dtype
        self.use_triton = dev.type == "cuda"

    def slot_tensors(self, layer_id: int) -> list[torch.Tensor]:
        out = [self.k_codes[layer_id], self.v_codes[layer_id], self.k_norm[layer_id], self.v_norm[layer_id]]
        return out + ([self.k_signs[layer_id], self.k_rnorm[layer_id]] if self.qjl else [])

    def describe(self) -> dict[str, Any]:
        return {"format": "turboquant", "bits": self.bits, "qjl": self.qjl, "seed": self.seed,
                "scales": "one norm per token and KV head, fp32; a shared Lloyd-Max codebook",
                **self.describe_prefix_attention()}

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              decode: bool, positions: torch.Tensor | None = None) -> None:
        kc, kn = quant.turboquant_quantize(k, self.rot, self.bounds)
        vc, vn = quant.turboquant_quantize(v, self.rot, self.bounds)
        self.k_codes[layer_id][loc] = quant.pack_chunks(kc, self.bits)
        self.v_codes[layer_id][loc] = quant.pack_chunks(vc, self.bits)
        self.k_norm[layer_id][loc] = kn
        self.v_norm[layer_id][loc] = vn
        if self.qjl:
            residual = k.float() - quant.turboquant_dequantize(kc, kn, self.rot, self.levels, torch.float32)
            signs, rnorm = quant.qjl_encode(residual, self.proj)
            self.k_signs[layer_id][loc] = quant.pack_chunks(signs.to(torch.uint8), 1)
            self.k_rnorm[layer_id][loc] = rnorm

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MSE reconstruction (without the QJL residual, which only attention scores use)."""
        kc = quant.unpack_chunks(self.k_codes[layer_id][slots], self.bits)
        vc = quant.unpack_chunks(self.v_codes[layer_id][slots], self.bits)
        k = quant.turboquant_dequantize(kc, self.k_norm[layer_id][slots], self.rot, self.levels, self.dtype)
        v = quant.turboquant_dequantize(vc, self.v_norm[layer_id][slots], self.rot, self.levels, self.dtype)
        return k, v

    def round_trip(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MSE reconstruction, as :meth:`read`'s; with ``qjl`` the keys carry the residual's estimate too. QJL's
        term is linear in the query (``q . (c ||r|| S^T sign(S r))``, ``c = sqrt(pi / 2) / M``), so a key plus that
        vector scores every query as :meth:`_scores` and the kernels do."""
        kc, kn = quant.turboquant_quantize(k, self.rot, self.bounds)
        vc, vn = quant.turboquant_quantize(v, self.rot, self.bounds)
        kq = quant.turboquant_dequantize(kc, kn, self.rot, self.levels, torch.float32)
        if self.qjl:
            signs, rnorm = quant.qjl_encode(k.float() - kq, self.proj)
            m = self.proj.shape[0]
            kq = kq + (torch.pi / 2) ** 0.5 / m * rnorm[..., None] * ((signs.float() * 2 - 1) @ self.proj)
        return kq.to(self.dtype), quant.turboquant_dequantize(vc, vn, self.rot, self.levels, self.dtype)

    def _scores(self, layer_id: int, q: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
        """Logits ``[Hq, n_q, n]`` of queries ``q`` ``[n_q, Hq, D]`` against ``slots``, QJL-corrected if on."""
        k, _ = self.read(layer_id, slots)
        group = q.shape[1] // k.shape[1]
        qf = q.float()
        logits = torch.einsum("thd,shd->hts", qf, k.float().repeat_interleave(group, dim=1))
        if self.qjl:
            signs = quant.unpack_chunks(self.k_signs[layer_id][slots], 1).float() * 2 - 1  # [n, Hkv, D]
            rn = self.k_rnorm[layer_id][slots]  # [n, Hkv]
            qp = qf @ self.proj.T  # [n_q, Hq, D]: S q
            est = torch.einsum("thm,shm->hts", qp, signs.repeat_interleave(group, dim=1))
            m = self.proj.shape[0]
            logits = logits + (torch.pi / 2) ** 0.5 / m * est * rn.repeat_interleave(group, dim=1).T[:, None, :]
        return logits * scale

    def row_attention(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, row: int, n: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The contract's reference attention, with the QJL-corrected scores."""
        slots = req_to_token[row, :n].long()
        _, v = self.read(layer_id, slots)
        group = q.shape[1] // v.shape[1]
        logits = self._scores(layer_id, q, slots, scale)
        out = torch.einsum("hts,shd->thd", torch.softmax(logits, dim=-1), v.float().repeat_interleave(group, dim=1))
        return out.to(q.dtype), torch.logsumexp(logits, dim=-1).transpose(0, 1)

    def layer(self, layer_id: int) -> turboquant_attention.Layer:
        """A layer's buffers, rotation and codebook, as the kernels read them."""
        qjl = (self.k_signs[layer_id], self.k_rnorm[layer_id], self.proj) if self.qjl else (None, None, None)
        return turboquant_attention.Layer(self.k_codes[layer_id], self.v_codes[layer_id], self.k_norm[layer_id],
                                          self.v_norm[layer_id], self.rot, self.unit_levels, *qjl)

    def decode(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.use_triton:
            return super().decode(layer_id, q, req_to_token, req_pool_indices, seq_lens, scale)
        return turboquant_attention.decode_attention(q, self.layer(layer_id), req_to_token, req_pool_indices,
                                                     seq_lens, scale)

    def prefix(self, layer_id: int, q: torch.Tensor, qo_indptr: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: list[int],
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_triton:
            return super().prefix(layer_id, q, qo_indptr, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                                  scale)
        # 16 tokens x the group's heads a tile (fp32 tiles: a 128-row one would spill its registers).
        bm = fp8_attention.prefix_block_m(q.shape[1] // self.k_codes[layer_id].shape[1], False)
        return turboquant_attention.prefix_attention(q, self.layer(layer_id), qo_indptr, req_to_token,
                                                     req_pool_indices, prefix_lens, scale, extend_lens, bm,
                                                     blocks=self._blocks.get(extend_lens, bm, q.device))


@register_method
class TurboQuant(SparseMethod[TurboQuantConfig]):
    """Every token kept and read; stored as rotated, Lloyd-Max-coded coordinates and a norm (+ QJL)."""

    name = "turboquant"
    family = Family.QUANTIZATION
    config_cls = TurboQuantConfig

    def __init__(self, config: TurboQuantConfig) -> None:
        super().__init__(config)
        self._store = TurboQuantStore(config)

    @property
    def store(self) -> TurboQuantStore:
        return self._store
