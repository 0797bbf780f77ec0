"""Dynamic selection in the server: sizing and placing a :class:`PageSelector`'s metadata, and the
CPU attention path that reads a selection.

* Memory: an AROUND hook on SGLang's per-token KV cell size (``integration/kv_pool.py``) adds the
  selector's metadata bytes per token, so SGLang sizes a pool that leaves room for it
  (``max_total_num_tokens = available // cell_size``); the attention backend then allocates it beside
  that pool, before CUDA-graph capture. So the metadata never comes from outside SGLang's memory budget.
* Attention: the backends call :func:`write_summaries` wherever a selecting layer's K is written and,
  in decode, read only the selected pages. On CPU (``torch_native``) :func:`attend_selected` does it
  per request with a mask over positions; the GPU path reads slot lists (``kernels/pages.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_sparse.contract import KVGeometry, PageSelector, SelectorStep
from sgl_sparse.kernels.pages import selected_positions_mask

logger = logging.getLogger(__name__)


def geometry_of(model_runner: Any) -> KVGeometry:
    from sglang.srt.runtime_context import get_parallel

    pool = model_runner.token_to_kv_pool
    mc = model_runner.model_config
    tp = get_parallel().attn_tp_size
    return KVGeometry(num_layers=mc.num_hidden_layers, num_q_heads=mc.num_attention_heads // tp,
                      num_kv_heads=pool.head_num, head_dim=pool.head_dim, page_size=pool.page_size,
                      num_slots=pool.size + pool.page_size, dtype=pool.dtype, device=torch.device(pool.device),
                      max_requests=int(model_runner.req_to_token_pool.req_to_token.shape[0]))


def allocate_once(selector: PageSelector, model_runner: Any) -> None:
    """Allocate the selector's metadata beside this runner's pool (a runner may build several backends)."""
    if getattr(selector, "_allocated_for", None) is model_runner.token_to_kv_pool:
        return
    g = geometry_of(model_runner)
    selector.allocate(g)
    selector._allocated_for = model_runner.token_to_kv_pool  # type: ignore[attr-defined]
    logger.info("sgl_sparse: %s metadata for %d pages of %d tokens (%.1f MiB)", type(selector).__name__, g.num_pages,
                g.page_size, selector.metadata_bytes_per_token(g) * g.num_slots / 2**20)


def write_summaries(selector: PageSelector, layer: Any, loc: torch.Tensor, k: torch.Tensor | None,
                    decode: bool = False) -> None:
    if k is None or getattr(layer, "is_cross_attention", False) or not selector.selects(layer.layer_id):
        return
    selector.on_kv_write(layer.layer_id, loc, k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim), decode=decode)


def _no_sliding_window(layer: Any) -> None:
    if getattr(layer, "sliding_window_size", None) not in (None, -1):
        raise ValueError("sgl_sparse: page selection on sliding-window layers is not supported (pages are "
                         "chosen over the whole context)")


def observe(selector: PageSelector, layer: Any, q: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
            forward_batch: Any) -> None:
    """After an observing layer's dense decode attention (its K of this step written)."""
    _no_sliding_window(layer)
    bs = forward_batch.seq_lens.shape[0]
    selector.observe(layer.layer_id, q.reshape(bs, layer.tp_q_head_num, layer.qk_head_dim), k_cache, req_to_token,
                     forward_batch.req_pool_indices, forward_batch.seq_lens)


def attend_selected(selector: PageSelector, layer: Any, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    seq_lens: torch.Tensor) -> torch.Tensor:
    """Decode attention of one selecting layer on CPU: ``q`` ``[bs, Hq, D]`` over the selected pages of
    each (request, KV head), ``[bs, Hq, Dv]``. Positions not selected are masked out; with every page
    selected it is the dense computation."""
    _no_sliding_window(layer)
    bs, hq, _ = q.shape
    hkv = layer.tp_k_head_num
    pages = selector.select(layer.layer_id, q, req_to_token, req_pool_indices, seq_lens)
    width = int(seq_lens.max()) if bs else 0
    mask = selected_positions_mask(pages, seq_lens, hkv, selector.page_size, width)  # [bs, Hkv, width]
    out = q.new_empty(bs, hq, layer.v_head_dim)
    for i in range(bs):
        n = int(seq_lens[i])
        slots = req_to_token[req_pool_indices[i], :n].long()
        k = k_cache[slots].movedim(0, 1).to(q.dtype)  # [Hkv, n, D]
        v = v_cache[slots].movedim(0, 1).to(q.dtype)
        m = mask[i, :, :n].repeat_interleave(hq // hkv, dim=0)  # [Hq, n]
        o = scaled_dot_product_attention(q[i][None, :, None, :], k[None], v[None], attn_mask=m[None, :, None, :],
                                         scale=layer.scaling, enable_gqa=hq != hkv)
        out[i] = o[0, :, 0]
    return out


def attend_itself(selector: PageSelector, layer: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  req_to_token: torch.Tensor, forward_batch: Any) -> torch.Tensor:
    """Decode attention of one selecting layer by a selector that ``attends`` (any base, CPU or GPU):
    ``q`` ``[bs, Hq, D]`` -> ``[bs, Hq, Dv]``."""
    _no_sliding_window(layer)
    return selector.attend(layer.layer_id, q, k_cache, v_cache, req_to_token, forward_batch.req_pool_indices,
                           forward_batch.seq_lens, float(layer.scaling))


def after_step(selector: PageSelector, batch: Any, model_runner: Any) -> None:
    """After a forward step, for a selector that ``maintains``: the step's rows with their logical
    lengths before and after it, from the scheduler's host copies (no sync)."""
    mode = batch.forward_mode
    if batch.seq_lens_cpu is None or not (mode.is_extend() or mode.is_decode()):
        return
    new = batch.seq_lens_cpu[: len(batch.reqs)].to(torch.int64)
    if mode.is_decode():
        old = new - 1
    else:
        prefix = getattr(batch, "prefix_lens", None)  # ScheduleBatch: per row, the length before this step
        if prefix is None:
            return
        old = torch.as_tensor(list(prefix)[: len(batch.reqs)], dtype=torch.int64)
    pool = model_runner.token_to_kv_pool
    selector.after_step(SelectorStep(batch.req_pool_indices[: len(batch.reqs)], old, new,
                                     model_runner.req_to_token_pool.req_to_token, pool.get_kv_buffer))
