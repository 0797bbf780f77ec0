"""SnapKV (Li et al., 2024, arXiv:2404.14469): keep the prompt positions the last window of queries
attends to most, scored at the end of prefill (optionally again every ``decode_interval`` tokens).

Physical eviction is one token set for all layers and heads (one pool slot holds every layer's K/V):
per layer and KV head, the window's softmax attention (GQA query heads of a group summed) is pooled
along positions (``kernel_size``, ``pooling``), then summed over heads and layers. Each softmax row
sums to one, so every layer and head weighs the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import (
    Family,
    KeepPlan,
    ObservationWindow,
    RequestState,
    SparseMethod,
    StepInfo,
)
from sgl_sparse.methods.eviction.base import topk_keep
from sgl_sparse.registry import register_method

POOLINGS = ("avgpool", "maxpool")


@dataclass(frozen=True)
class SnapKVConfig(MethodConfig):
    method_name = "snapkv"
    budget: int = 8192  # retained tokens, sink and window included
    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"
    sink_tokens: int = 64
    decode_interval: int = 0  # 0: select once at prefill end; N: re-select every N decoded tokens

    def validate(self) -> None:
        self.require(self.budget >= 1, "budget", "must be >= 1")
        self.require(self.window_size >= 1, "window_size", "must be >= 1")
        self.require(self.window_size <= self.budget, "window_size", f"must be <= budget ({self.budget})")
        self.require(self.sink_tokens >= 0, "sink_tokens", "must be >= 0")
        self.require(self.sink_tokens + self.window_size <= self.budget, "sink_tokens",
                     f"+ window_size must be <= budget ({self.budget})")
        self.require(self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size", "must be odd and >= 1")
        self.require(self.pooling in POOLINGS, "pooling", f"must be one of {list(POOLINGS)}")
        self.require(self.decode_interval >= 0, "decode_interval", "must be >= 0")


def per_head_scores_torch(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """``[Hkv, n]``: each key's softmax probability summed over window queries and GQA group (the CPU
    path; materializes ``[Hkv, G, w, n]`` float32 logits)."""
    w, n_heads, d = q.shape
    n_kv = k.shape[1]
    qf = q.float().view(w, n_kv, n_heads // n_kv, d)
    logits = torch.einsum("wgjd,ngd->gjwn", qf, k.float()) * scale
    logits = logits.masked_fill(k_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
    return logits.softmax(-1).nan_to_num(0.0).sum(dim=(1, 2))


def window_scores(q: torch.Tensor, k_buffer: torch.Tensor, k_rows: torch.Tensor, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, scale: float, kernel_size: int, pooling: str) -> torch.Tensor:
    """Score of each key position for one layer: ``[n]`` (float32).

    q ``[w, H, D]``; key ``i`` is ``k_buffer[k_rows[i]]`` (``[Hkv, D]``) at position ``k_pos[i]``.
    Causal by logical position (a window query never sees a later key). On GPU a Triton kernel
    streams the keys from the buffer in place (:mod:`sgl_sparse.kernels.window_scores`)."""
    if k_buffer.is_cuda:
        from sgl_sparse.kernels.window_scores import window_scores_per_head

        per_head = window_scores_per_head(q, k_buffer, q_pos, k_pos, scale, k_rows=k_rows)
    else:
        per_head = per_head_scores_torch(q, k_buffer[k_rows], q_pos, k_pos, scale)
    pad = kernel_size // 2
    if kernel_size > 1:
        pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
        kwargs = {"count_include_pad": False} if pooling == "avgpool" else {}
        per_head = pool(per_head[:, None, :], kernel_size, stride=1, padding=pad, **kwargs)[:, 0, :]
    return per_head.sum(0)


def observation_scores(window: ObservationWindow, kernel_size: int, pooling: str) -> torch.Tensor:
    """``[n]``: :func:`window_scores` of ``window``'s retained keys summed over its layers (this rank's heads; the
    caller sums over the TP group). Also the scored keep ``snapkv_global`` of a request's own prune
    (:mod:`sgl_sparse.prune_keep`)."""
    total: torch.Tensor | None = None
    on_device: tuple[torch.Tensor, ...] | None = None  # copied once, not per layer
    for layer in range(window.num_layers):
        buf = window.key_buffer(layer)
        if on_device is None:
            on_device = (window.key_rows.to(buf.device), window.q_pos.to(buf.device), window.k_pos.to(buf.device))
        s = window_scores(window.queries[layer], buf, *on_device, window.scale, kernel_size, pooling)
        total = s if total is None else total + s
    assert total is not None
    return total


@register_method
class SnapKV(SparseMethod[SnapKVConfig]):
    name = "snapkv"
    family = Family.EVICTION
    config_cls = SnapKVConfig
    evicts = True

    def observation_window(self) -> int:
        return self.config.window_size

    def observes_decode(self) -> bool:
        return self.config.decode_interval > 0

    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        if state.num_kept <= self.config.budget:
            return False
        if step.final_prefill:
            return True
        di = self.config.decode_interval
        return not step.is_prefill and di > 0 and step.decoded_tokens % di == 0

    def on_observation(self, state: RequestState, window: ObservationWindow) -> None:
        # Under TP this rank scored its own heads; every rank must select from the sum over all of them.
        total = window.reduce_heads(observation_scores(window, self.config.kernel_size, self.config.pooling))
        state.extra["scores"] = (window.k_pos.cpu(), total.cpu())

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        scored = state.extra.pop("scores", None)
        if scored is None:
            return None
        positions, scores = scored
        cfg = self.config
        keep = topk_keep(positions, scores, cfg.budget, cfg.sink_tokens, cfg.window_size)
        return KeepPlan(keep) if keep.numel() < positions.numel() else None
