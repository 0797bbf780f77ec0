"""sgl_sparse: sparse-first KV-cache serving as a plug-in for stock SGLang 0.5.17.

The core (config, contract, rules, registry, methods, kernels, pruning, the tree's records) imports only
torch/triton; everything that touches ``sglang.srt`` lives in :mod:`sgl_sparse.integration`, plus the radix tree
(:mod:`sgl_sparse.radix.tree`), which subclasses SGLang's.
"""

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import Family, SparseMethod
from sgl_sparse.errors import SparseConfigError
from sgl_sparse.registry import create_method, get_method_class, register_method, registered_methods

__version__ = "0.1.0"
__all__ = [
    "Family",
    "MethodConfig",
    "SparseConfigError",
    "SparseMethod",
    "create_method",
    "get_method_class",
    "register_method",
    "registered_methods",
]
