"""Everything that touches ``sglang.srt`` internals (pinned to SGLang 0.5.17) lives here.

* :mod:`.plugin`      - the ``sglang.srt.plugins`` entry point: registers backends and hooks.
* :mod:`.handoff`     - how the launcher hands the method config to the scheduler processes.
* :mod:`.launch`      - ``python -m sgl_sparse.launch_server`` argument handling.
* :mod:`.attention`   - our attention backend (CPU: torch_native-based, GPU: Triton-based).
* :mod:`.cpu_support` - the CPU fallbacks SGLang 0.5.17 lacks (RoPE, name-based Triton dispatch).
* :mod:`.server_info` - the ``sgl_sparse`` block of ``/server_info`` internal states.
"""

SGLANG_VERSION = "0.5.17"
BACKEND_NAME = "sgl_sparse"  # name of both our radix-cache and attention backends
from sgl_sparse.slots import SENTINEL_SLOT  # noqa: E402,F401  (re-exported: one definition, sgl_sparse.slots)
