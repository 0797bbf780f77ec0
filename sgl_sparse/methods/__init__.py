"""Built-in methods, one module per method, grouped by family. Importing this registers them."""

from sgl_sparse.methods import dense  # noqa: F401
from sgl_sparse.methods.compression import deltakv, palu  # noqa: F401
from sgl_sparse.methods.eviction import h2o, kvzip, pyramidkv, rkv, skipkv, snapkv, streamingllm  # noqa: F401
from sgl_sparse.methods.quantization import fp8_kv, kivi, turboquant  # noqa: F401
from sgl_sparse.methods.selection import omnikv, quest, retroinfer  # noqa: F401
