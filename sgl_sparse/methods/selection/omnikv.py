"""OmniKV (Hao et al., ICLR 2025; antgroup/OmniKV): token selection shared across layers.

Every KV entry stays resident (prefix caching works as for dense). In decode, a few *filter* layers
attend densely and score every token of the request with the current query (OmniKV's "last"
selector: the largest ``q . k`` over all query heads); the ``token_budget`` best tokens, sink and
recent always among them, are what every following layer reads, up to the next filter layer. Layers
before the first filter layer are dense. One token set per request, shared by all KV heads (as in
OmniKV). Differences from the original, on purpose:

* a fixed ``token_budget`` (a static list width that CUDA graphs need) instead of a fraction of the
  prompt (0.067); the default 2,048 = 64 sink + 1,472 selected + 512 recent is SparseEngine's setting
  (its Table 12), which scores sink and recent out of the competition as here;
* decode-generated tokens older than the recent window compete like prompt tokens (the original
  keeps every generated token; SparseEngine, as here, does not);
* no dense "wait" layer after each filter layer (that exists to hide the original's CPU offload).

``filter_layers``: comma-separated layer ids, or ``"auto"``: OmniKV's ``2,8,18`` for 32 layers,
scaled to the model's depth (at least layer 1, so layer 0 stays a dense non-filter layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import Family, KVGeometry, PageSelector, SparseMethod
from sgl_sparse.kernels import omnikv
from sgl_sparse.kernels.pages import randomize_scores, select_pages
from sgl_sparse.registry import register_method

ORIGINAL_FILTER_LAYERS = (2, 8, 18)  # antgroup/OmniKV configs/example.json, Llama-3-8B (32 layers)


def parse_filter_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """The filter layers of ``spec`` for a model of ``num_layers`` layers (raises ``ValueError``)."""
    if spec == "auto":
        picked = sorted({max(1, round(layer * num_layers / 32)) for layer in ORIGINAL_FILTER_LAYERS})
        layers = tuple(x for x in picked if x < num_layers - 1) or (0,)
    else:
        layers = tuple(int(x) for x in spec.split(","))
    if any(x >= num_layers for x in layers):
        raise ValueError(f"omnikv: filter_layers {spec!r}: the model has {num_layers} layers (ids 0..{num_layers - 1})")
    return layers


@dataclass(frozen=True)
class OmniKVConfig(MethodConfig):
    """``token_budget`` tokens each non-filter layer past the first filter layer reads per decode
    step, of which the first ``sink_tokens`` and the last ``recent_tokens`` always."""

    method_name = "omnikv"
    token_budget: int = 2048
    sink_tokens: int = 64
    recent_tokens: int = 512
    filter_layers: str = "auto"
    # "max_logit": OmniKV's scores; "random": random tokens under the same budget (a quality control).
    scoring: str = "max_logit"

    def validate(self) -> None:
        self.require(self.scoring in ("max_logit", "random"), "scoring", "must be 'max_logit' or 'random'")
        self.require(self.sink_tokens >= 0, "sink_tokens", "must be >= 0")
        self.require(self.recent_tokens >= 1, "recent_tokens", "must be >= 1: the token being written is always read")
        self.require(self.token_budget > self.sink_tokens + self.recent_tokens, "token_budget",
                     f"must exceed sink_tokens + recent_tokens ({self.sink_tokens + self.recent_tokens}), or "
                     "nothing is selected")
        if self.filter_layers != "auto":
            parts = self.filter_layers.split(",")
            ok = all(p.strip().isdigit() for p in parts)
            self.require(ok, "filter_layers", "must be 'auto' or comma-separated layer ids, e.g. '2,8,18'")
            ids = [int(p) for p in parts]
            self.require(ids == sorted(set(ids)), "filter_layers", "must be strictly increasing")


class OmniKVSelector(PageSelector):
    """No metadata: a filter layer's :meth:`observe` scores the tokens and keeps the selection, which
    :meth:`select` hands to every layer up to the next filter layer (the tensors live for one step;
    inside a captured graph they are the graph's own)."""

    page_size = 1

    def __init__(self, config: OmniKVConfig) -> None:
        self.config = config
        self.filters: tuple[int, ...] | None = None
        self.use_triton = False
        self._pages: torch.Tensor | None = None  # [bs * Hkv, token_budget] of the step being run

    def _filters(self) -> tuple[int, ...]:
        if self.filters is None:
            raise RuntimeError("omnikv: the selector was used before allocate() (the model's layer count)")
        return self.filters

    def selects(self, layer_id: int) -> bool:
        f = self._filters()
        return layer_id > f[0] and layer_id not in f

    def observes(self, layer_id: int) -> bool:
        return layer_id in self._filters()

    @property
    def pages_per_row(self) -> int:
        return self.config.token_budget

    def allocate(self, g: KVGeometry) -> None:
        self.filters = parse_filter_layers(self.config.filter_layers, g.num_layers)
        self.use_triton = g.device.type == "cuda"

    def observe(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        c = self.config
        bs = q.shape[0]
        scores = torch.full((bs, req_to_token.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        score = omnikv.score_tokens if self.use_triton else omnikv.score_tokens_torch
        score(q, k_cache, req_to_token, req_pool_indices, seq_lens, scores, c.sink_tokens, c.recent_tokens)
        if c.scoring == "random":
            scores = randomize_scores(scores)
        self._pages = select_pages(scores, c.token_budget).repeat_interleave(k_cache.shape[1], dim=0)

    def select(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
        if self._pages is None:
            raise RuntimeError("omnikv: a selecting layer ran before this step's filter layer")
        return self._pages


@register_method
class OmniKV(SparseMethod[OmniKVConfig]):
    name = "omnikv"
    family = Family.SELECTION
    config_cls = OmniKVConfig

    def __init__(self, config: OmniKVConfig) -> None:
        super().__init__(config)
        self._selector = OmniKVSelector(config)

    @property
    def selector(self) -> OmniKVSelector:
        return self._selector
