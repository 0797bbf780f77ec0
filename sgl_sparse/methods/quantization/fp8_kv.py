"""FP8 KV with per-(token, head) scales: E4M3 codes, one dynamic fp32 scale per token and KV head.

SGLang 0.5.17's own ``--kv-cache-dtype fp8_e4m3`` has one scale per tensor (from the checkpoint, else
1.0), so an outlier head or token clips or underflows everything else; a scale of ``amax / 448`` per
(token, head) keeps each row's full E4M3 range. Per token and layer the pool stores ``2 * Hkv * D``
bytes of codes and ``2 * Hkv * 4`` of scales: 2,112 bytes against bf16's 4,096 for a Llama-3-8B layer
(8 KV heads of 128), i.e. 1.94x the tokens in the same memory. Attention dequantizes in registers
(``kernels/fp8_attention.py``); on CPU the contract's torch reference reads through :meth:`read`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import Family, KVGeometry, KVStore, SparseMethod
from sgl_sparse.kernels import fp8_attention, quant
from sgl_sparse.methods.quantization.base import QuantConfig
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class FP8KVConfig(QuantConfig):
    """The scales are dynamic, one per (token, KV head); ``prefix_attention`` as :class:`QuantConfig`'s."""

    method_name = "fp8_kv"


class FP8Store(KVStore):
    """Per layer: K and V codes ``[slots, Hkv, D]`` uint8 (E4M3 bits), K and V scales ``[slots, Hkv]`` fp32."""

    gpu_kernels = True

    def __init__(self, prefix_attention: str = "kernel") -> None:
        self.choose_prefix_attention(prefix_attention)
        self.k_codes: list[torch.Tensor] = []
        self.v_codes: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        self.dtype = torch.bfloat16
        self.use_triton = False
        self._blocks = fp8_attention.StepBlocks()

    def bytes_per_token(self, g: KVGeometry) -> int:
        return g.num_layers * 2 * g.num_kv_heads * (g.head_dim + 4)

    def allocate(self, g: KVGeometry) -> None:
        codes = (g.num_slots, g.num_kv_heads, g.head_dim)
        # One codes tensor per K and V with the scales in their own: the kernels index both by slot with the
        # same strides (the decode kernel asserts it).
        self.k_codes = [torch.zeros(codes, dtype=torch.uint8, device=g.device) for _ in range(g.num_layers)]
        self.v_codes = [torch.zeros(codes, dtype=torch.uint8, device=g.device) for _ in range(g.num_layers)]
        self.k_scale = [torch.zeros(codes[:2], dtype=torch.float32, device=g.device) for _ in range(g.num_layers)]
        self.v_scale = [torch.zeros(codes[:2], dtype=torch.float32, device=g.device) for _ in range(g.num_layers)]
        self.dtype = g.dtype
        self.use_triton = g.device.type == "cuda"

    def slot_tensors(self, layer_id: int) -> list[torch.Tensor]:
        return [self.k_codes[layer_id], self.v_codes[layer_id], self.k_scale[layer_id], self.v_scale[layer_id]]

    def describe(self) -> dict[str, Any]:
        return {"format": "e4m3", "bits": 8, "scales": "per token and KV head, fp32",
                **self.describe_prefix_attention()}

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              decode: bool, positions: torch.Tensor | None = None) -> None:
        kc, ks = quant.fp8_quantize(k)
        vc, vs = quant.fp8_quantize(v)
        self.k_codes[layer_id][loc] = kc.view(torch.uint8)
        self.v_codes[layer_id][loc] = vc.view(torch.uint8)
        self.k_scale[layer_id][loc] = ks
        self.v_scale[layer_id][loc] = vs

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = quant.fp8_dequantize(self.k_codes[layer_id][slots].view(torch.float8_e4m3fn),
                                 self.k_scale[layer_id][slots], self.dtype)
        v = quant.fp8_dequantize(self.v_codes[layer_id][slots].view(torch.float8_e4m3fn),
                                 self.v_scale[layer_id][slots], self.dtype)
        return k, v

    def round_trip(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return (quant.fp8_dequantize(*quant.fp8_quantize(k), self.dtype),
                quant.fp8_dequantize(*quant.fp8_quantize(v), self.dtype))

    def decode(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.use_triton:
            return super().decode(layer_id, q, req_to_token, req_pool_indices, seq_lens, scale)
        return fp8_attention.decode_attention(q, self.k_codes[layer_id], self.k_scale[layer_id],
                                              self.v_codes[layer_id], self.v_scale[layer_id], req_to_token,
                                              req_pool_indices, seq_lens, scale)

    def prefix(self, layer_id: int, q: torch.Tensor, qo_indptr: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: list[int],
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_triton:
            return super().prefix(layer_id, q, qo_indptr, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                                  scale)
        bm = fp8_attention.prefix_block_m(q.shape[1] // self.k_codes[layer_id].shape[1], True)
        return fp8_attention.prefix_attention(q, self.k_codes[layer_id], self.k_scale[layer_id],
                                              self.v_codes[layer_id], self.v_scale[layer_id], qo_indptr,
                                              req_to_token, req_pool_indices, prefix_lens, scale, extend_lens,
                                              blocks=self._blocks.get(extend_lens, bm, q.device))


@register_method
class FP8KV(SparseMethod[FP8KVConfig]):
    """Every token kept and read, stored in E4M3 with per-(token, head) scales."""

    name = "fp8_kv"
    family = Family.QUANTIZATION
    config_cls = FP8KVConfig

    def __init__(self, config: FP8KVConfig) -> None:
        super().__init__(config)
        self._store = FP8Store(config.prefix_attention)

    @property
    def store(self) -> FP8Store:
        return self._store
