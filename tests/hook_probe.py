"""A method that records every contract hook the server drives, in order, to a file (one JSON line per
call): how ``tests/test_hook_order_e2e.py`` checks the contract's docstring against a real server. It
reaches the server through ``SGLSPARSE_METHOD_MODULES=tests.hook_probe``.

It declares everything that makes the runtime drive hooks (``evicts``, an observation window, a
selector), and changes nothing: it keeps every token, and its selector selects every token, so its
outputs are dense. Layer 0 observes and layers 1.. select (OmniKV's shape, with the first layer as the
filter); with ``attends`` they attend themselves (densely) instead, and ``after_step`` is logged too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import (
    Family,
    KVGeometry,
    ObservationWindow,
    PageSelector,
    PrefillChunk,
    RequestState,
    SelectorStep,
    SparseMethod,
    StepInfo,
    TreePayload,
)
from sgl_sparse.kernels.pages import select_pages
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class HookProbeConfig(MethodConfig):
    method_name = "hook_probe"
    log_path: str = ""
    width: int = 4096  # tokens per selection: at least the context, so every token is read
    # A selector that attends itself (attend, not select) and maintains (after_step), as RetroInfer's.
    attends: bool = False


class _Log:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, hook: str, **fields: object) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"hook": hook, "pid": os.getpid(), **fields}) + "\n")


class ProbeSelector(PageSelector):
    page_size = 1

    def __init__(self, config: HookProbeConfig, log: _Log) -> None:
        self.config, self.log = config, log
        self.num_kv_heads = 1

    def selects(self, layer_id: int) -> bool:
        return layer_id > 0

    def observes(self, layer_id: int) -> bool:
        return layer_id == 0

    @property
    def pages_per_row(self) -> int:
        return self.config.width

    def allocate(self, g: KVGeometry) -> None:
        self.num_kv_heads = g.num_kv_heads
        self.log("allocate", layers=g.num_layers)

    def on_kv_write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, decode: bool = False) -> None:
        self.log("on_kv_write", layer=layer_id, n=int(loc.shape[0]))

    def observe(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self.log("observe", layer=layer_id, bs=int(q.shape[0]))

    def select(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
        self.log("select", layer=layer_id, bs=int(q.shape[0]))
        width = req_to_token.shape[1]
        pos = torch.arange(width, device=q.device)[None, :]
        scores = torch.where(pos < seq_lens[:, None], torch.zeros(1, device=q.device),
                             torch.full((1,), float("-inf"), device=q.device))
        return select_pages(scores, self.config.width).repeat_interleave(self.num_kv_heads, dim=0)


class AttendingProbeSelector(ProbeSelector):
    """Attends itself (densely, so outputs stay dense) and maintains: logs ``attend`` and ``after_step``."""

    attends = True
    maintains = True

    def attend(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        self.log("attend", layer=layer_id, bs=int(q.shape[0]))
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            slots = req_to_token[req_pool_indices[i], : int(seq_lens[i])].long()
            k, v = k_cache[slots].movedim(0, 1)[None], v_cache[slots].movedim(0, 1)[None]
            out[i] = scaled_dot_product_attention(q[i][None, :, None, :], k.to(q.dtype), v.to(q.dtype), scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])[0, :, 0]
        return out

    def after_step(self, step: SelectorStep) -> None:
        self.log("after_step", bs=int(step.new_lens.numel()), old=step.old_lens.tolist(), new=step.new_lens.tolist())


@register_method
class HookProbe(SparseMethod[HookProbeConfig]):
    name = "hook_probe"
    family = Family.EVICTION
    config_cls = HookProbeConfig
    evicts = True

    def __init__(self, config: HookProbeConfig) -> None:
        super().__init__(config)
        self.log = _Log(config.log_path)
        self._selector = (AttendingProbeSelector if config.attends else ProbeSelector)(config, self.log)

    @property
    def selector(self) -> ProbeSelector:
        return self._selector

    def new_state(self, rid: str) -> RequestState:
        self.log("new_state", rid=rid)
        return RequestState(rid=rid)

    def restore_state(self, state: RequestState, payload: TreePayload | None) -> None:
        self.log("restore_state", rid=state.rid, logical_len=state.logical_len)

    def on_prefill_chunk(self, state: RequestState, chunk: PrefillChunk) -> None:
        self.log("on_prefill_chunk", rid=state.rid, start=chunk.start, end=chunk.end, total=chunk.total)

    def on_prune(self, state: RequestState, pruned: torch.Tensor) -> None:
        self.log("on_prune", rid=state.rid, pruned=pruned.tolist(), kept=state.num_kept)

    def observation_window(self) -> int:
        return 1

    def on_observation(self, state: RequestState, window: ObservationWindow) -> None:
        self.log("on_observation", rid=state.rid, keys=int(window.k_pos.numel()))

    def on_step_end(self, state: RequestState, step: StepInfo) -> None:
        self.log("on_step_end", rid=state.rid, prefill=step.is_prefill, final=step.final_prefill,
                 new=step.new_tokens, logical_len=state.logical_len)

    def on_finish(self, state: RequestState) -> TreePayload | None:
        self.log("on_finish", rid=state.rid, logical_len=state.logical_len)
        return None
