"""CPU fallbacks SGLang 0.5.17 lacks, applied only in processes of a ``--device cpu`` server.

1. RoPE: ``RotaryEmbedding.__init__`` (layers/rotary_embedding/base.py L103-124) imports
   ``vllm._custom_ops`` when no platform flag matches, and a CUDA build of torch on a machine without
   GPU matches none. The module global ``_is_cpu`` is read at construction time, so setting it in the
   scheduler process (our plug-in runs first thing in ``run_scheduler_process``, before the model is
   built) selects the native path. Dispatch stays ``forward_native``.
2. Name-based Triton dispatch: ``utils.common.support_triton(name)`` decides between Triton and torch
   helper kernels (``write_cache_indices``, ``compute_position``) by the attention backend's *name*;
   our backend's name is not ``torch_native``, so on CPU it must answer False for it too.
3. The paged allocator (``--page-size`` > 1, which Quest needs): ``PagedTokenToKVPoolAllocator``'s
   ``alloc_extend``/``alloc_decode`` (mem_cache/allocator/paged.py L172-259) launch Triton kernels,
   whatever the device. On CPU they run the same page arithmetic in torch: SGLang's own
   ``alloc_extend_naive`` and its decode counterpart here.
"""

from __future__ import annotations

import logging

import torch

from sgl_sparse.integration import BACKEND_NAME

logger = logging.getLogger(__name__)

_TORCH_ONLY_BACKENDS = ("torch_native", "intel_amx", BACKEND_NAME)


def support_triton_cpu(backend: str) -> bool:
    """Replacement for ``sglang.srt.utils.common.support_triton`` on CPU servers."""
    return backend not in _TORCH_ONLY_BACKENDS


def _alloc_decode_naive(seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor,
                        page_size: int) -> tuple[torch.Tensor, int]:
    """``alloc_decode_kernel`` in torch: a request whose new token starts a page takes the next free
    page (in batch order), the others the slot after their last one."""
    new_page = (seq_lens - 1) % page_size == 0
    nth = torch.cumsum(new_page.long(), 0) - 1
    fresh = free_pages[nth.clamp(min=0)] * page_size if free_pages.numel() else torch.zeros_like(last_loc)
    return torch.where(new_page, fresh, last_loc + 1).to(torch.int64), int(new_page.sum())


def alloc_extend_cpu(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,  # type: ignore[no-untyped-def]
                     extend_num_tokens, num_new_pages=None):
    """REPLACE of ``PagedTokenToKVPoolAllocator.alloc_extend`` on CPU (same bookkeeping, torch kernel)."""
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive
    from sglang.srt.utils import get_num_new_pages

    bs = len(prefix_lens)
    if self.need_sort and extend_num_tokens // self.page_size + bs + 1 > len(self.free_pages):
        self.merge_and_sort_free()
    if num_new_pages is None:
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
    if num_new_pages > len(self.free_pages):
        return None
    out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
    alloc_extend_naive(prefix_lens, seq_lens, last_loc, self.free_pages, out, self.page_size, self.device)
    self.free_pages = self.free_pages[num_new_pages:]
    return out


def alloc_decode_cpu(self, seq_lens, seq_lens_cpu, last_loc):  # type: ignore[no-untyped-def]
    """REPLACE of ``PagedTokenToKVPoolAllocator.alloc_decode`` on CPU."""
    if self.need_sort and len(seq_lens) > len(self.free_pages):
        self.merge_and_sort_free()
    out, num_new_pages = _alloc_decode_naive(seq_lens, last_loc, self.free_pages, self.page_size)
    if num_new_pages > len(self.free_pages):
        return None
    self.free_pages = self.free_pages[num_new_pages:]
    return out


def register_cpu_support() -> None:
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    rope_base._is_cpu = True
    HookRegistry.register("sglang.srt.utils.common.support_triton", support_triton_cpu, HookType.REPLACE)
    paged = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
    HookRegistry.register(f"{paged}.alloc_extend", alloc_extend_cpu, HookType.REPLACE)
    HookRegistry.register(f"{paged}.alloc_decode", alloc_decode_cpu, HookType.REPLACE)
    logger.info("sgl_sparse: CPU support active (native RoPE, torch helper kernels for %s)", BACKEND_NAME)
