"""Quest (Tang et al., 2024, arXiv:2406.10774): query-aware page selection from per-page key bounds.

Every KV entry stays resident (prefix caching works as for dense); each decode step, in every layer
past the first ``dense_layers``, each (request, KV head) reads the ``token_budget // page_size``
pages with the highest bound on ``q . k`` (sink and recent pages always among them). Defaults: the
Quest repository's 16-token pages and 2 dense layers; SparseEngine's 2,048-token budget with 64 sink
and 512 recent tokens (the same split as Vortex's 4 sink + 32 recent + 92 selected pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import Family, KVGeometry, PageSelector, SparseMethod
from sgl_sparse.kernels import quest
from sgl_sparse.kernels.pages import randomize_scores, select_pages, select_pages_triton
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class QuestConfig(MethodConfig):
    """``token_budget`` tokens a decode query reads per layer and KV head (whole pages of
    ``page_size``, the KV pool's page size), of which the first ``sink_tokens`` and the last
    ``recent_tokens`` always; the first ``dense_layers`` layers read everything."""

    method_name = "quest"
    token_budget: int = 2048
    page_size: int = 16
    sink_tokens: int = 64
    recent_tokens: int = 512
    dense_layers: int = 2
    # "bounds": Quest's page scores; "random": random pages under the same budget (a control for quality
    # comparisons, as kvpress's RandomPress is for eviction).
    scoring: str = "bounds"

    def validate(self) -> None:
        ps = self.page_size
        self.require(self.scoring in ("bounds", "random"), "scoring", "must be 'bounds' or 'random'")
        self.require(ps in (1, 2, 4, 8, 16, 32, 64, 128), "page_size", "must be a power of two from 1 to 128")
        for name in ("token_budget", "sink_tokens", "recent_tokens"):
            self.require(getattr(self, name) % ps == 0, name, f"must be a multiple of page_size ({ps})")
        self.require(self.sink_tokens >= 0, "sink_tokens", "must be >= 0")
        self.require(self.recent_tokens >= ps, "recent_tokens", f"must be >= page_size ({ps}): the page being "
                     "written is always read")
        self.require(self.token_budget > self.sink_tokens + self.recent_tokens, "token_budget",
                     f"must exceed sink_tokens + recent_tokens ({self.sink_tokens + self.recent_tokens}), or "
                     "nothing is selected")
        self.require(self.dense_layers >= 0, "dense_layers", "must be >= 0")


class QuestSelector(PageSelector):
    """Per selecting layer, the min and max of each physical page's keys (``[num_pages, Hkv, D]``, KV
    dtype), written where K is written; page 0 is SGLang's padding page (never scored)."""

    def __init__(self, config: QuestConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.kmin: dict[int, torch.Tensor] = {}
        self.kmax: dict[int, torch.Tensor] = {}
        self.use_triton = False
        # The Triton threshold select (same lists as torch.topk + sort, tests/gpu/test_gpu_selection.py) is
        # several times faster than top-k + sort at long rows (benchmarks/selection_overhead.py): on wherever
        # the Triton scoring runs.
        self.triton_select = True

    def selects(self, layer_id: int) -> bool:
        return layer_id >= self.config.dense_layers

    @property
    def pages_per_row(self) -> int:
        return self.config.token_budget // self.page_size

    def _layers(self, g: KVGeometry) -> list[int]:
        return [i for i in range(g.num_layers) if self.selects(i)]

    def metadata_bytes_per_token(self, g: KVGeometry) -> int:
        per_page = 2 * len(self._layers(g)) * g.num_kv_heads * g.head_dim * torch.empty(0, dtype=g.dtype).element_size()
        return -(-per_page // self.page_size)

    def allocate(self, g: KVGeometry) -> None:
        shape = (g.num_pages, g.num_kv_heads, g.head_dim)
        for i in self._layers(g):
            self.kmin[i] = torch.full(shape, float("inf"), dtype=g.dtype, device=g.device)
            self.kmax[i] = torch.full(shape, float("-inf"), dtype=g.dtype, device=g.device)
        self.use_triton = g.device.type == "cuda"

    def on_kv_write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, decode: bool = False) -> None:
        if decode and self.use_triton:
            quest.update_decode_summaries(self.kmin[layer_id], self.kmax[layer_id], loc, k, self.page_size)
        else:
            quest.update_page_summaries(self.kmin[layer_id], self.kmax[layer_id], loc, k, self.page_size)

    def select(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
        kmin, kmax = self.kmin[layer_id], self.kmax[layer_id]
        max_pages = -(-req_to_token.shape[1] // self.page_size)
        scores = torch.empty(q.shape[0] * kmin.shape[1], max_pages, dtype=torch.float32, device=q.device)
        score = quest.score_pages if self.use_triton else quest.score_pages_torch
        score(q, kmin, kmax, req_to_token, req_pool_indices, seq_lens, scores, self.page_size,
              self.config.sink_tokens // self.page_size, self.config.recent_tokens // self.page_size)
        if self.config.scoring == "random":
            scores = randomize_scores(scores)
        # The Triton select reads only each row's real pages (torch's relies on the -inf past them).
        if self.use_triton and self.triton_select:
            return select_pages_triton(scores, self.pages_per_row, seq_lens, kmin.shape[1], self.page_size)
        return select_pages(scores, self.pages_per_row)


@register_method
class Quest(SparseMethod[QuestConfig]):
    name = "quest"
    family = Family.SELECTION
    config_cls = QuestConfig

    def __init__(self, config: QuestConfig) -> None:
        super().__init__(config)
        self._selector = QuestSelector(config)

    @property
    def selector(self) -> QuestSelector:
        return self._selector
