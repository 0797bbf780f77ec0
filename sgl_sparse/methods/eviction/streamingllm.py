"""StreamingLLM (Xiao et al., 2023, arXiv:2309.17453): keep attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import Family, KeepPlan, RequestState, SparseMethod, StepInfo
from sgl_sparse.methods.eviction.base import sink_recent_keep
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class StreamingLLMConfig(MethodConfig):
    """``sink_tokens`` first tokens + ``recent_tokens`` last ones are kept; the cache may overshoot by
    ``evict_interval`` tokens before compacting again (amortises the eviction step), so at most
    ``sink_tokens + recent_tokens + evict_interval`` are retained."""

    method_name = "streamingllm"
    sink_tokens: int = 64
    recent_tokens: int = 512
    evict_interval: int = 64

    def validate(self) -> None:
        self.require(self.sink_tokens >= 0, "sink_tokens", "must be >= 0")
        self.require(self.recent_tokens >= 1, "recent_tokens", "must be >= 1")
        self.require(self.evict_interval >= 1, "evict_interval", "must be >= 1")


@register_method
class StreamingLLM(SparseMethod[StreamingLLMConfig]):
    """Applies at the end of prefill (down to the budget) and during decode (when the retained set
    exceeds budget + interval). No scoring, so it needs no layer hooks."""

    name = "streamingllm"
    family = Family.EVICTION
    config_cls = StreamingLLMConfig
    evicts = True

    @property
    def budget(self) -> int:
        return self.config.sink_tokens + self.config.recent_tokens

    def on_step_end(self, state: RequestState, step: StepInfo) -> KeepPlan | None:
        if step.is_prefill and not step.final_prefill:
            return None  # the prompt is compacted once, when complete
        limit = self.budget if step.is_prefill else self.budget + self.config.evict_interval
        if state.num_kept <= limit:
            return None
        return KeepPlan(sink_recent_keep(state.kept, self.config.sink_tokens, self.config.recent_tokens))
