"""A lossless method-owned KV layout (the model dtype, unchanged) for the store path's exactness test: with
it, everything the server does for a store (the pool subclass, the write hook, the split extend merged by
log-sum-exp, the store's decode) must give dense's tokens. Reaches the server through
``SGLSPARSE_METHOD_MODULES=tests.plain_store``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_sparse.contract import Family, KVGeometry, KVStore, SparseMethod
from sgl_sparse.methods.quantization.base import QuantConfig
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class PlainStoreConfig(QuantConfig):
    """``prefix_attention`` as the real stores' (``auto`` by default: the prefix read dequantized, here exactly)."""

    method_name = "plain_store"


class PlainStore(KVStore):
    def bytes_per_token(self, g: KVGeometry) -> int:
        return g.num_layers * 2 * g.num_kv_heads * g.head_dim * torch.empty(0, dtype=g.dtype).element_size()

    def allocate(self, g: KVGeometry) -> None:
        shape = (g.num_slots, g.num_kv_heads, g.head_dim)
        self.k = [torch.zeros(shape, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
        self.v = [torch.zeros(shape, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]

    def slot_tensors(self, layer_id: int) -> list[torch.Tensor]:
        return [self.k[layer_id], self.v[layer_id]]

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              decode: bool, positions: torch.Tensor | None = None) -> None:
        self.k[layer_id][loc] = k.to(self.k[layer_id].dtype)
        self.v[layer_id][loc] = v.to(self.v[layer_id].dtype)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id][slots], self.v[layer_id][slots]

    def round_trip(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


@register_method
class PlainStoreMethod(SparseMethod[PlainStoreConfig]):
    name = "plain_store"
    family = Family.QUANTIZATION
    config_cls = PlainStoreConfig

    def __init__(self, config: PlainStoreConfig) -> None:
        super().__init__(config)
        self._store = PlainStore()
        self._store.choose_prefix_attention(config.prefix_attention)

    @property
    def store(self) -> PlainStore:
        return self._store
