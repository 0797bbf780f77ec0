"""Decode attention over a page selection on FlashInfer (GPU), inside CUDA graphs.

Design (docs/selection.md; ../shared/notes/flashinfer-backend-map.md §2.3-2.4):
a selecting layer reads one KV list per (request, KV head). FlashInfer has one list per request, so
the KV is viewed head-flattened: K/V ``[N, Hkv, D]`` as ``[N * Hkv, 1, D]`` (one KV head), queries
``[bs, Hq, D]`` as ``[bs * Hkv, G, D]`` (the group of KV head ``h`` is query heads ``h*G..h*G+G-1``),
list entries ``slot * Hkv + h``. One extra decode wrapper (tensor-core kernel, any group size) plans
this flattened batch once per step, beside the stock wrappers that the dense layers keep using.

Every list's length follows from the sequence length (``kernels/pages.selected_lens``), so the
host-side plan is exact without a sync (from ``seq_lens_cpu``), the device ``indptr`` is built from
``seq_lens`` on the device, and per layer only the list *contents* change (``expand_pages`` into a
fixed buffer), which a captured graph allows (indptr is fixed per replay, so PDL ordering is moot).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from sgl_sparse.contract import PageSelector
from sgl_sparse.kernels.pages import expand_pages, selected_lens


class FlashInferSelection:
    """The flattened wrapper(s) and their buffers for one backend."""

    def __init__(self, backend: Any, selector: PageSelector) -> None:
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        upd = backend.indices_updater_decode
        self.selector = selector
        self.hkv = upd.num_kv_heads
        self.group = upd.num_qo_heads // upd.num_kv_heads
        self.head_dim = upd.head_dim
        self.data_type, self.q_data_type = upd.data_type, upd.q_data_type
        self.workspace = backend.workspace_buffer
        self.width = selector.pages_per_row * selector.page_size  # tokens per list, at most
        self.eager = BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self.graph: dict[int, Any] = {}  # batch size -> wrapper over the graph buffers
        self.cg_indptr: torch.Tensor | None = None
        self.cg_indices: torch.Tensor | None = None
        self.ones: torch.Tensor | None = None
        # The lists of the step being run: (wrapper, device indptr, indices buffer).
        self.current: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        # The pages last expanded into them: OmniKV hands the same tensor to every layer up to the next
        # filter layer, so the slot lists are built once per group (a graph captures that once too).
        self.expanded_from: torch.Tensor | None = None

    # -- per-step plan ----------------------------------------------------------------------------
    def _lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        lens = selected_lens(seq_lens.long(), self.selector.page_size, self.selector.pages_per_row)
        return lens.repeat_interleave(self.hkv).to(torch.int32)

    def _ones(self, n: int, device: torch.device) -> torch.Tensor:
        if self.ones is None or self.ones.numel() < n:
            self.ones = torch.ones(max(n, 1024), dtype=torch.int32, device=device)
        return self.ones[:n]

    def _fill_indptr(self, indptr: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """``indptr[: rows + 1]`` from the device lengths, in place, no sync."""
        rows = seq_lens.shape[0] * self.hkv
        out = indptr[: rows + 1]
        out[:1].zero_()
        out[1:] = torch.cumsum(self._lens(seq_lens), 0)
        return out

    def _host_indptr(self, seq_lens_cpu: torch.Tensor) -> torch.Tensor:
        lens = self._lens(seq_lens_cpu.cpu())
        host = torch.zeros(lens.numel() + 1, dtype=torch.int32)
        host[1:] = torch.cumsum(lens, 0)
        return host

    def plan_eager(self, fb: Any) -> None:
        """Eager decode: plan the flattened batch (FlashInfer reads the device indptr back, one sync per
        step, as the stock eager decode plan does)."""
        device = fb.seq_lens.device
        rows = fb.seq_lens.shape[0] * self.hkv
        if rows == 0:
            self.current = None
            return
        indptr = self._fill_indptr(torch.empty(rows + 1, dtype=torch.int32, device=device), fb.seq_lens)
        total = int(self._lens(fb.seq_lens_cpu.cpu()).sum()) if fb.seq_lens_cpu is not None else rows * self.width
        indices = torch.empty(max(total, 1), dtype=torch.int32, device=device)
        self.eager.plan(indptr, indices, self._ones(rows, device), self.group, 1, self.head_dim, 1,
                        data_type=self.data_type, q_data_type=self.q_data_type, non_blocking=True)
        self.current, self.expanded_from = (self.eager, indptr, indices), None

    def init_graph_state(self, max_bs: int, device: torch.device) -> None:
        rows = max_bs * self.hkv
        self.cg_indptr = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.cg_indices = torch.zeros(rows * self.width, dtype=torch.int32, device=device)
        self._ones(rows, device)

    def plan_graph(self, fb: Any, in_capture: bool) -> None:
        """Graph decode (capture and each replay): the device indptr into the graph buffer, the host plan
        from ``seq_lens_cpu`` (exact: no sync)."""
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan

        assert self.cg_indptr is not None and self.cg_indices is not None
        bs = fb.batch_size
        rows = bs * self.hkv
        if rows == 0:
            self.current = None
            return
        indptr = self._fill_indptr(self.cg_indptr, fb.seq_lens[:bs])
        last = self._ones(rows, fb.seq_lens.device)
        host = self._host_indptr(fb.seq_lens_cpu[:bs]) if fb.seq_lens_cpu is not None else indptr.cpu()
        w = self.graph.get(bs)
        if w is None or in_capture:
            w = BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=self.cg_indptr[: rows + 1], paged_kv_indices_buffer=self.cg_indices,
                paged_kv_last_page_len_buffer=last)
            # The first plan builds the kernel module; later replays re-plan on the host only.
            w.plan(indptr, self.cg_indices, last, self.group, 1, self.head_dim, 1, data_type=self.data_type,
                   q_data_type=self.q_data_type, non_blocking=True)
            w.begin_forward = partial(fast_decode_plan, w)
            self.graph[bs] = w
        else:
            w.begin_forward(indptr, self.cg_indices, last, self.group, 1, self.head_dim, 1,
                            data_type=self.data_type, q_data_type=self.q_data_type, non_blocking=True,
                            global_override_indptr_cpu=host)
        self.current, self.expanded_from = (w, indptr, self.cg_indices), None

    # -- per layer ----------------------------------------------------------------------------------
    def attend(self, layer: Any, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        assert self.current is not None, "sgl_sparse: a selecting layer ran without a planned selection"
        wrapper, indptr, indices = self.current
        bs = seq_lens.shape[0]
        q3 = q.contiguous().view(bs, layer.tp_q_head_num, layer.head_dim)
        pages = self.selector.select(layer.layer_id, q3, req_to_token, req_pool_indices, seq_lens)
        if pages is not self.expanded_from:
            expand_pages(pages, req_to_token, req_pool_indices, seq_lens, indptr, indices, self.selector.page_size,
                         flatten_heads=True)
            self.expanded_from = pages
        k, v = kv_cache
        d = layer.head_dim
        o = wrapper.forward(q3.view(bs * self.hkv, self.group, d), (k.view(-1, 1, d), v.view(-1, 1, d)),
                            sm_scale=layer.scaling, logits_soft_cap=layer.logit_cap, k_scale=layer.k_scale_float,
                            v_scale=layer.v_scale_float)
        return o.view(bs, layer.tp_q_head_num * d)
