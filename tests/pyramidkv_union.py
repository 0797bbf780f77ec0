"""PyramidKV's negative control for ``tests/test_pyramidkv_e2e.py``: the same selection and the same union
resident, but every layer reads the whole union (its selector never receives the layers' sets). Loaded into a
server through ``SGLSPARSE_METHOD_MODULES=tests.pyramidkv_union``; the e2e test shows the real method's outputs
differ from it (so the server's layers do read their own sets) with the same slots in use."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_sparse.contract import RequestState
from sgl_sparse.methods.eviction.pyramidkv import (
    LayerKeepSelector,
    LayerSets,
    PyramidKV,
    PyramidKVConfig,
    max_layer_set,
)
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class PyramidKVUnionConfig(PyramidKVConfig):
    method_name = "pyramidkv_union"


class UnionSelector(LayerKeepSelector):
    def set_request(self, state: RequestState, sets: LayerSets | None) -> None:
        super().set_request(state, None)  # no sets: every live position, i.e. the union


@register_method
class PyramidKVUnion(PyramidKV):
    name = "pyramidkv_union"
    config_cls = PyramidKVUnionConfig

    def __init__(self, config: PyramidKVUnionConfig) -> None:
        super().__init__(config)
        self._selector = UnionSelector(max_layer_set(config))
