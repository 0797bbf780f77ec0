"""RetroInfer (Chen et al., 2025; microsoft/RetrievalAttention): clustered keys, exact + estimated reads.

Every KV entry stays resident (prefix caching works as for dense). Each ``segment_tokens`` segment of
a request's keys (from the first page boundary past the ``sink_tokens``) is clustered per KV head into
``segment_tokens / cluster_size`` clusters once it lies wholly before the ``recent_tokens``: at the
end of the prefill that completes it, or in decode. A decode step of a selecting layer ranks the
request's clusters by the softmax of ``q . centroid`` summed over the query group, reads the top
``retrieval_ratio`` of them exactly, estimates the next ``estimation_ratio`` from their value sums,
and reads everything else that is not clustered (sink, tail, segments not indexed) exactly, under one
softmax. Requests shorter than ``min_index_tokens`` of clustered keys are read densely. Layout, math
and the deviations from the original (segments clustered alone, 1,024 tokens, not 8K with a global
assignment) are in :mod:`sgl_sparse.kernels.retroinfer` and docs/methods/retroinfer.md.

Index validity is data on the device: each page holds a build stamp, cleared wherever K is written
to it and set, for all pages of a segment, by the build that clustered it. A segment is used only
when all its pages carry one build's stamp; a segment is built only over pages no build claims, so a
segment that mixes pages shared through the prefix tree with new ones (a match that ends inside it)
is read exactly instead of rebuilt over another request's index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_sparse.config import MethodConfig
from sgl_sparse.contract import Family, KVGeometry, PageSelector, SelectorStep, SparseMethod
from sgl_sparse.kernels import retroinfer as ri
from sgl_sparse.kernels.pages import randomize_scores
from sgl_sparse.registry import register_method


@dataclass(frozen=True)
class RetroInferConfig(MethodConfig):
    """Defaults: SparseEngine's port of RetroInfer (sink 4, recent 64, clusters of 16 tokens on average,
    1.8% retrieved, 23.2% estimated, 10 k-means iterations, an index once 16K tokens lie between sink
    and recent); ``segment_tokens`` is the original's update segment."""

    method_name = "retroinfer"
    sink_tokens: int = 4
    recent_tokens: int = 64
    cluster_size: int = 16
    segment_tokens: int = 1024
    retrieval_ratio: float = 0.018
    estimation_ratio: float = 0.232
    min_index_tokens: int = 16384
    kmeans_iters: int = 10
    dense_layers: int = 0
    # "centroids": RetroInfer's ranking; "random": random clusters ranked under the same budgets (a
    # quality control).
    scoring: str = "centroids"

    def validate(self) -> None:
        self.require(self.scoring in ("centroids", "random"), "scoring", "must be 'centroids' or 'random'")
        pow2 = self.cluster_size >= 1 and self.cluster_size & (self.cluster_size - 1) == 0
        self.require(pow2, "cluster_size", "must be a power of two (it is the KV pool's page size)")
        self.require(self.segment_tokens % max(self.cluster_size, 1) == 0 and self.segment_tokens >= 16
                     and self.segment_tokens // max(self.cluster_size, 1) >= 1, "segment_tokens",
                     "must be a multiple of cluster_size and at least 16")
        self.require(self.segment_tokens <= 32768, "segment_tokens", "must be <= 32768 (member order is int16)")
        self.require(self.sink_tokens >= 0, "sink_tokens", "must be >= 0")
        self.require(self.recent_tokens >= 1, "recent_tokens", "must be >= 1: the token being written is always read")
        self.require(0 < self.retrieval_ratio <= 1, "retrieval_ratio", "must be in (0, 1]")
        self.require(0 <= self.estimation_ratio <= 1, "estimation_ratio", "must be in [0, 1]")
        self.require(self.min_index_tokens >= self.segment_tokens, "min_index_tokens",
                     "must be >= segment_tokens (at least one segment)")
        self.require(self.kmeans_iters >= 1, "kmeans_iters", "must be >= 1")
        self.require(self.dense_layers >= 0, "dense_layers", "must be >= 0")

    def layout(self) -> ri.Layout:
        page = self.cluster_size
        return ri.Layout(base=-(-self.sink_tokens // page) * page, seg=self.segment_tokens, page=page,
                         recent=self.recent_tokens, min_segments=-(-self.min_index_tokens // self.segment_tokens),
                         retrieval=self.retrieval_ratio, estimation=self.estimation_ratio)


class RetroInferSelector(PageSelector):
    """Per selecting layer an :class:`~sgl_sparse.kernels.retroinfer.IndexStore` over the pool, one
    stamp per page for all layers (they are built together), and the decode attention itself."""

    attends = True
    maintains = True

    def __init__(self, config: RetroInferConfig) -> None:
        self.config = config
        self.layout = config.layout()
        self.page_size = config.cluster_size
        self.stores: dict[int, ri.IndexStore] = {}
        self.stamps: torch.Tensor | None = None  # [pages] int32: 0 = no build claims the page
        self.use_triton = False
        self._ranked_width: dict[int, int] = {}
        self._seg_valid: torch.Tensor | None = None  # [bs, max segments] of the step being run
        self._budgets: tuple[torch.Tensor, torch.Tensor] = (torch.zeros(0), torch.zeros(0))  # its [bs] r and e
        self._first_layer = config.dense_layers

    def selects(self, layer_id: int) -> bool:
        return layer_id >= self.config.dense_layers

    def metadata_bytes_per_token(self, g: KVGeometry) -> int:
        layers = max(g.num_layers - self.config.dense_layers, 0)
        per = ri.index_bytes_per_token(self.page_size, g.num_kv_heads, g.head_dim, g.dtype, layers)
        return per + -(-4 // self.page_size)  # the stamps

    def allocate(self, g: KVGeometry) -> None:
        if self.config.dense_layers >= g.num_layers:
            raise ValueError(f"retroinfer: dense_layers {self.config.dense_layers}: the model has only {g.num_layers} "
                             "layers, so nothing would be selected")
        self.stores = {layer: ri.IndexStore.empty(g.num_slots, self.page_size, g.num_kv_heads, g.head_dim, g.dtype,
                                                  g.device)
                       for layer in range(self.config.dense_layers, g.num_layers)}
        self.stamps = torch.zeros(g.num_pages, dtype=torch.int32, device=g.device)
        self.use_triton = g.device.type == "cuda"

    def on_kv_write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, decode: bool = False) -> None:
        if layer_id == self._first_layer and self.stamps is not None:
            # New content: no index covers the page any more. index_fill_ (not ``stamps[idx] = 0``, which copies
            # the 0 from the host and fails inside a CUDA-graph capture, tests/gpu/test_gpu_retroinfer.py).
            self.stamps.index_fill_(0, loc.long() // self.page_size, 0)

    # -- decode -------------------------------------------------------------------------------------
    def _max_segments(self, req_to_token: torch.Tensor) -> int:
        return max((req_to_token.shape[1] - self.layout.base) // self.layout.seg, 1)

    def _segment_pages(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_seg: int) -> torch.Tensor:
        """``[bs, max_seg, clusters]`` physical pages of each segment (positions clamped to the row)."""
        lay = self.layout
        c = lay.clusters_per_segment
        pos = (lay.base + torch.arange(max_seg, device=req_to_token.device)[:, None] * lay.seg
               + torch.arange(c, device=req_to_token.device)[None, :] * lay.page).flatten()
        pos = pos.clamp(max=req_to_token.shape[1] - 1)
        slots = req_to_token[req_pool_indices.long()[:, None], pos[None, :]].long()
        return (slots // lay.page).view(-1, max_seg, c)

    def _valid(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_seg: int) -> torch.Tensor:
        """Segments whose pages all carry one build's stamp (``[bs, max_seg]`` int8)."""
        assert self.stamps is not None, "allocated before the first forward"
        st = self.stamps[self._segment_pages(req_to_token, req_pool_indices, max_seg)]
        return ((st[:, :, 0] != 0) & (st == st[:, :, :1]).all(dim=2)).to(torch.int8)

    def attend(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        max_seg = self._max_segments(req_to_token)
        if layer_id == self._first_layer or self._seg_valid is None or self._seg_valid.shape[0] != q.shape[0]:
            # Once a step (every layer's index is built together): which segments are usable, and the budgets
            # that follow from them (a score-free dozen small kernels, not to be paid in every layer).
            self._seg_valid = self._valid(req_to_token, req_pool_indices, max_seg)
            self._budgets = ri.row_budgets(seq_lens, self._seg_valid, self.layout, max_seg)
        seg_valid = self._seg_valid
        r, e = self._budgets
        store = self.stores[layer_id]
        score = ri.cluster_scores if self.use_triton else ri.cluster_scores_torch
        scores = score(q, store, req_to_token, req_pool_indices, seq_lens, seg_valid, self.layout, scale, max_seg)
        if self.config.scoring == "random":
            scores = randomize_scores(scores)
        width = self._ranked_width.get(req_to_token.shape[1])
        if width is None:
            width = self._ranked_width[req_to_token.shape[1]] = self.layout.max_ranked(req_to_token.shape[1])
        if self.use_triton:
            ranked = ri.rank_clusters_triton(scores, width, r, e, store.centroids.shape[1])
        else:
            ranked = ri.rank_clusters(scores, width)
        attend = ri.decode_attention if self.use_triton else ri.decode_attention_torch
        return attend(q, k_cache, v_cache, store, req_to_token, req_pool_indices, seq_lens, seg_valid, ranked, r, e,
                      self.layout, scale)

    # -- index builds -------------------------------------------------------------------------------
    def after_step(self, step: SelectorStep) -> None:
        """Cluster the segments this step completed (wholly before the recent window now, not before)."""
        lay = self.layout
        # Segments complete before the step were built then (by this request, or by the one whose
        # prefix it matched: that one was at least as long); under min_segments nothing was, and the
        # step that reaches it builds from segment 0.
        done_before = lay.num_segments(step.old_lens.long()).tolist()
        done_now = lay.num_segments(step.new_lens.long()).tolist()
        rows, segs = [], []
        for i, (a, b) in enumerate(zip(done_before, done_now)):
            for s in range(a, b):
                rows.append(i)
                segs.append(s)
        if not rows:
            return
        dev = step.req_to_token.device
        rpi = step.req_pool_indices.long()[_to_device(torch.tensor(rows), dev)]
        seg_t = _to_device(torch.tensor(segs), dev)
        pages = self._pages_of(step.req_to_token, rpi, seg_t)  # [n, C]
        # Build only over pages no build claims (a valid segment is left as it is; a segment mixing
        # claimed and new pages stays unindexed), and only once per segment in this call.
        stamps = self.stamps
        assert stamps is not None, "allocated before the first forward"
        free = (stamps[pages] == 0).all(dim=1)
        for layer, store in self.stores.items():
            k, v = step.kv(layer)
            ri.build_segments(store, k, v, step.req_to_token, rpi, seg_t, lay, self.config.kmeans_iters,
                              write=free)
        # One stamp per segment, the same for two rows that build the very segment (shared pages):
        # its first page (a page sits at one logical position, so it starts one segment only).
        cur = stamps[pages]
        stamp = (pages[:, :1] + 1).to(torch.int32).expand_as(cur)
        stamps[pages] = torch.where(free[:, None], stamp, cur)

    def _pages_of(self, req_to_token: torch.Tensor, rows: torch.Tensor, segs: torch.Tensor) -> torch.Tensor:
        slots = ri.segment_slots(req_to_token, rows, segs, self.layout)
        return slots[:, :: self.layout.page] // self.layout.page


@register_method
class RetroInfer(SparseMethod[RetroInferConfig]):
    name = "retroinfer"
    family = Family.SELECTION
    config_cls = RetroInferConfig

    def __init__(self, config: RetroInferConfig) -> None:
        super().__init__(config)
        self._selector = RetroInferSelector(config)

    @property
    def selector(self) -> RetroInferSelector:
        return self._selector


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host (pinned, non-blocking on CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
