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

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import ObservationWindow, RequestState, StepInfo
from sgl_sparse.methods.eviction.base import POOLINGS, Budget, ScoredEviction, compacts_now, observation_scores
from sgl_sparse.registry import register_method


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


@register_method
class SnapKV(ScoredEviction[SnapKVConfig]):
    name = "snapkv"
    config_cls = SnapKVConfig

    def observation_window(self) -> int:
        return self.config.window_size

    def observes_decode(self) -> bool:
        return self.config.decode_interval > 0

    def wants_observation(self, state: RequestState, step: StepInfo) -> bool:
        return compacts_now(state, step, self.config.budget, self.config.decode_interval)

    def budget(self) -> Budget:
        return Budget(self.config.budget, self.config.sink_tokens, self.config.window_size)

    def score(self, state: RequestState, window: ObservationWindow) -> torch.Tensor:
        return observation_scores(window, self.config.kernel_size, self.config.pooling)
