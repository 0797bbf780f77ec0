"""Everything that touches ``sglang.srt`` internals (pinned to SGLang 0.5.17) lives here, by role.

Launch and hook-up (the launcher's process, then each scheduler process):

* :mod:`.launch`      - ``python -m sgl_sparse.launch_server``: flags, launch errors, the hand-off.
* :mod:`.handoff`     - how the launcher hands the method config to the scheduler processes.
* :mod:`.plugin`      - the ``sglang.srt.plugins`` entry point: registers backends and hooks.
* :mod:`.cpu_support` - the CPU fallbacks SGLang 0.5.17 lacks (RoPE, name-based Triton dispatch, paging).

The scheduler side (per step, host):

* :mod:`.runtime`, :mod:`.step`, :mod:`.per_request` - the method, per-request state, the after-forward step.
* :mod:`.capture`, :mod:`.replay`, :mod:`.frees`, :mod:`.tables`, :mod:`.tp` - window queries, replay forwards,
  freed slots, device tables, the TP reduction of scores.

The model-runner side (per layer, device):

* :mod:`.attention`          - our attention backend and its CPU base (torch_native) and Triton base.
* :mod:`.flashinfer_backend` - the FlashInfer-based backend (the CUDA default).
* :mod:`.selection`, :mod:`.flashinfer_selection` - dynamic page selection (CPU path, FlashInfer path).
* :mod:`.store_attention`, :mod:`.kv_pool` - attention over and the pool of a method-owned KV layout.
* :mod:`.syncs`              - the check that a decode step never waits for the GPU.

HTTP: :mod:`.validation` (requests), :mod:`.prune_route` (Prefix-Cache Pruning), :mod:`.chat_resume` (the chat
template's resume point), :mod:`.server_info` and :mod:`.metrics` (what the server reports).
"""

SGLANG_VERSION = "0.5.17"
BACKEND_NAME = "sgl_sparse"  # name of both our radix-cache and attention backends
from sgl_sparse.slots import SENTINEL_SLOT  # noqa: E402,F401  (re-exported: one definition, sgl_sparse.slots)
