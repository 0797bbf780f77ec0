"""The shape of the KV pool a :class:`~sgl_sparse.contract.PageSelector`'s metadata or a
:class:`~sgl_sparse.contract.KVStore`'s buffers are sized from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """The KV pool (this rank's share of it)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_slots: int  # pool slots, SGLang's padding page included
    dtype: torch.dtype
    device: torch.device
    max_requests: int = 0  # rows of SGLang's req_to_token (request slots), for per-request buffers

    @property
    def num_pages(self) -> int:
        return -(-self.num_slots // self.page_size)
