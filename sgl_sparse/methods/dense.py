"""Dense attention: every hook is the contract's default, so serving equals vanilla SGLang."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import Family, SparseMethod
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class DenseConfig(MethodConfig):
    """No fields: dense attention keeps and reads every token."""

    method_name = "dense"


@register_method
class Dense(SparseMethod[DenseConfig]):
    """Full KV, full attention. The baseline every sparse method is compared against."""

    name = "dense"
    family = Family.DENSE
    config_cls = DenseConfig
