"""RetroInfer (Chen et al., 2025; microsoft/RetrievalAttention): clustered keys, exact + estimated decode.

What the original does is written down in docs/methods/retroinfer.md. Here it is laid out for a
batched, CUDA-graph-safe decode over SGLang's paged KV pool (page size ``P``, the average cluster size):

* **Segments.** A request's keys from ``base`` (the first page boundary at or past the sink tokens) on
  are cut into segments of ``SEG`` tokens at fixed logical positions, and each segment is clustered on
  its own into ``SEG / P`` clusters per KV head (spherical k-means, :func:`kmeans_segments`). The
  original clusters the prompt in 8K-token segments and then assigns every key against all
  centroids; clustering each segment alone (as the original does for every 1,024 decoded tokens) makes
  a segment's index a function of its own KV only, so a prefix shared through the radix tree shares
  its index exactly. Cluster ``j`` of segment ``k`` is stored at the metadata row of the segment's
  ``j``-th physical page (:class:`IndexStore`): the store is indexed by page, as Quest's summaries,
  and SGLang's pool sizing pays for it.
* **Decode** (per request, KV head, :func:`decode_attention`): the clusters of the request's usable
  segments are ranked by the softmax of ``q . centroid`` summed over the group's query heads; the top
  ``R`` are read exactly (their member tokens), the next ``E`` are estimated from their value sums
  (``exp(q . centroid) * value_sum`` in the numerator, ``exp(q . centroid) * size`` in the
  denominator), and the sink, the tail (every token past the last full segment before the ``recent``
  window) and any segment whose index is not usable are read exactly, all under one softmax.
  ``R = min(max(round(0.018 C), 1), C)``, ``E = min(round(0.232 C), C - R)`` for ``C`` usable clusters,
  as the original's budgets.

Plain torch (:func:`decode_attention_torch`, :func:`cluster_scores_torch`) is the reference and the
CPU path; :func:`decode_attention` is the Triton kernel (a loop bound per row from ``seq_lens``, so a
graph captured at full width does no work past a row's real length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels.pages import _keys, _kth_key, _row_keys, _taken, row_blocks
from sgl_sparse.kernels.splits import merge_splits, split_workspace, store_split
from sgl_sparse.kernels.splits import online_step as _online

NEG = float("-inf")


@dataclass(frozen=True)
class Layout:
    """Where a request's segments lie: ``base`` (page-aligned start of segment 0), ``seg`` tokens a
    segment, ``page`` tokens a page (= clusters are ``seg // page`` a segment), ``recent`` trailing
    tokens always exact, ``min_segments`` below which a request is read densely (the original builds
    no index under 16K tokens)."""

    base: int
    seg: int
    page: int
    recent: int
    min_segments: int
    retrieval: float
    estimation: float

    @property
    def clusters_per_segment(self) -> int:
        return self.seg // self.page

    def num_segments(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Segments wholly before the recent window (0 under ``min_segments``); host or device tensors."""
        n = torch.div((seq_lens - self.recent - self.base).clamp(min=0), self.seg, rounding_mode="floor")
        return torch.where(n >= self.min_segments, n, torch.zeros_like(n))

    def budgets(self, clusters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Retrieved and estimated cluster counts for ``clusters`` usable ones (the original's rounding
        is Python's; half-up here, on the device)."""
        c = clusters.to(torch.float64)
        r = torch.minimum(torch.floor(c * self.retrieval + 0.5).clamp(min=1), c)
        e = torch.minimum(torch.floor(c * self.estimation + 0.5), c - r)
        return r.to(torch.int32), e.to(torch.int32)

    def max_ranked(self, max_len: int) -> int:
        """Static width of the ranking for contexts up to ``max_len`` (retrieved + estimated)."""
        c = max(int(self.num_segments(torch.tensor([max_len]))[0]), self.min_segments) * self.clusters_per_segment
        r, e = self.budgets(torch.tensor([c]))
        return max(int(r[0] + e[0]), 1)


# -- index build ------------------------------------------------------------------------------------
@dataclass
class SegmentIndex:
    """The clusters of ``B`` independent segments (a segment of one KV head each), ``S`` tokens, ``C``
    clusters: ``centroids`` ``[B, C, D]`` (the plain mean key of each cluster's members), ``value_sums``
    ``[B, C, D]`` (fp32), ``sizes`` ``[B, C]`` int32, ``offsets`` ``[B, C]`` int32 (start of each
    cluster's members in ``order``), ``order`` ``[B, S]`` int32 (segment-local positions, grouped by
    cluster, ascending inside a cluster)."""

    centroids: torch.Tensor
    value_sums: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor


def kmeans_segments(keys: torch.Tensor, values: torch.Tensor, clusters: int, iters: int = 10) -> SegmentIndex:
    """RetroInfer's spherical k-means on each of ``B`` segments (``keys``/``values`` ``[B, S, D]``):
    keys centred on their segment mean; centroids start at evenly spaced keys; ``iters - 1`` rounds of
    argmax-inner-product assignment and normalised-mean update (an empty cluster keeps its centroid);
    a last assignment gives the members. Batched matmuls, no host sync."""
    b, s, d = keys.shape
    x = keys.to(torch.float32)
    x = x - x.mean(dim=1, keepdim=True)
    init = ((torch.arange(clusters, device=keys.device, dtype=torch.float64) + 0.5) * s / clusters).long()
    cent = x[:, init]
    for _ in range(max(iters - 1, 0)):
        assign = torch.bmm(x, cent.transpose(1, 2)).argmax(dim=2)  # [B, S]
        sums = torch.zeros_like(cent).scatter_add_(1, assign[:, :, None].expand(b, s, d), x)
        count = torch.zeros(b, clusters, device=keys.device).scatter_add_(1, assign, torch.ones_like(x[:, :, 0]))
        new = sums / count.clamp(min=1)[:, :, None]
        new = new / new.norm(dim=2, keepdim=True).clamp(min=1e-12)
        cent = torch.where(count[:, :, None] > 0, new, cent)
    assign = torch.bmm(x, cent.transpose(1, 2)).argmax(dim=2)
    idx = assign[:, :, None].expand(b, s, d)
    count = torch.zeros(b, clusters, dtype=torch.int32, device=keys.device).scatter_add_(
        1, assign, torch.ones_like(assign, dtype=torch.int32))
    ksum = torch.zeros(b, clusters, d, device=keys.device).scatter_add_(1, idx, keys.to(torch.float32))
    vsum = torch.zeros(b, clusters, d, device=keys.device).scatter_add_(1, idx, values.to(torch.float32))
    centroids = (ksum / count.clamp(min=1)[:, :, None]).to(keys.dtype)
    order = torch.sort(assign, dim=1, stable=True).indices.to(torch.int32)
    offsets = (torch.cumsum(count, dim=1) - count).to(torch.int32)
    return SegmentIndex(centroids, vsum, count, offsets, order)


@dataclass
class IndexStore:
    """One layer's index metadata over the KV pool: per physical page (``[pages, Hkv, ...]``) the
    centroid, value sum, size and member offset of the cluster stored there; per slot ``[slots, Hkv]``
    the ``order`` entry of the segment-local position that slot holds."""

    centroids: torch.Tensor
    value_sums: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor

    @staticmethod
    def empty(num_slots: int, page: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device | str,
              ) -> IndexStore:
        pages = -(-num_slots // page)
        return IndexStore(torch.zeros(pages, hkv, d, dtype=dtype, device=device),
                          torch.zeros(pages, hkv, d, dtype=dtype, device=device),
                          torch.zeros(pages, hkv, dtype=torch.int32, device=device),
                          torch.zeros(pages, hkv, dtype=torch.int32, device=device),
                          torch.zeros(num_slots, hkv, dtype=torch.int16, device=device))

    @staticmethod
    def bytes_per_token(page: int, hkv: int, d: int, dtype: torch.dtype) -> float:
        elem = torch.empty(0, dtype=dtype).element_size()
        return hkv * ((2 * d * elem + 8) / page + 2)


def segment_slots(req_to_token: torch.Tensor, rows: torch.Tensor, segs: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Slots ``[n, SEG]`` of segment ``segs[i]`` of request row ``rows[i]``."""
    pos = layout.base + segs.long()[:, None] * layout.seg + torch.arange(layout.seg, device=rows.device)[None, :]
    return req_to_token[rows.long()[:, None], pos].long()


def build_segments(store: IndexStore, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                   rows: torch.Tensor, segs: torch.Tensor, layout: Layout, iters: int = 10,
                   write: torch.Tensor | None = None) -> None:
    """Cluster segment ``segs[i]`` of request row ``rows[i]`` (every KV head) from the pool's K/V and
    write it into ``store`` at the segment's pages and slots; only where ``write[i]`` (``[n]`` bool,
    device) when given, without a host sync (the others' rows keep what they hold)."""
    n = int(rows.numel())
    if n == 0:
        return
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    slots = segment_slots(req_to_token, rows, segs, layout)  # [n, SEG]
    keys = k_cache[slots].permute(0, 2, 1, 3).reshape(n * hkv, layout.seg, d)
    values = v_cache[slots].permute(0, 2, 1, 3).reshape(n * hkv, layout.seg, d)
    idx = kmeans_segments(keys, values, layout.clusters_per_segment, iters)
    c = layout.clusters_per_segment
    pages = (slots[:, :: layout.page] // layout.page)  # [n, C]: the page holding cluster j
    def per_page(t: torch.Tensor) -> torch.Tensor:  # [n * Hkv, C, ...] -> [n, C, Hkv, ...]
        return t.reshape(n, hkv, c, *t.shape[2:]).transpose(1, 2)
    def put(buf: torch.Tensor, at: torch.Tensor, new: torch.Tensor) -> None:
        new = new.to(buf.dtype)
        if write is not None:
            keep = write.view(-1, *([1] * (new.dim() - 1)))
            new = torch.where(keep, new, buf[at])
        buf[at] = new

    put(store.centroids, pages, per_page(idx.centroids))
    put(store.value_sums, pages, per_page(idx.value_sums))
    put(store.sizes, pages, per_page(idx.sizes))
    put(store.offsets, pages, per_page(idx.offsets))
    put(store.order, slots, idx.order.reshape(n, hkv, layout.seg).transpose(1, 2))


# -- ranking ----------------------------------------------------------------------------------------
def cluster_scores_torch(q: torch.Tensor, store: IndexStore, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seg_valid: torch.Tensor,
                         layout: Layout, scale: float, max_segments: int) -> torch.Tensor:
    """``[bs * Hkv, max_segments * C]`` fp32: each usable cluster's softmax probability (over the row's
    usable clusters) summed over the KV head's query heads; ``-inf`` for the rest (empty clusters,
    segments past the row's count or not usable). ``seg_valid`` ``[bs, >= max_segments]`` (bool/int)."""
    bs, hq, d = q.shape
    hkv = store.centroids.shape[1]
    c = layout.clusters_per_segment
    width = max_segments * c
    j = torch.arange(width, device=q.device)
    pos = layout.base + (j // c) * layout.seg + (j % c) * layout.page  # first token of each cluster's page
    slots = req_to_token[req_pool_indices.long()[:, None], pos[None, :].clamp(max=req_to_token.shape[1] - 1)].long()
    pages = slots // layout.page  # [bs, W]
    cent = store.centroids[pages].to(torch.float32)  # [bs, W, Hkv, D]
    size = store.sizes[pages]  # [bs, W, Hkv]
    nseg = layout.num_segments(seq_lens.long())
    usable = (j[None, :] // c < nseg[:, None]) & seg_valid[:, :max_segments].bool().repeat_interleave(c, dim=1)
    ok = usable[:, :, None] & (size > 0)  # [bs, W, Hkv]
    qg = q.to(torch.float32).view(bs, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,bwhd->bhgw", qg, cent) * scale  # [bs, Hkv, G, W]
    s = s.masked_fill(~ok.permute(0, 2, 1)[:, :, None, :], NEG)
    return _group_probs(s.reshape(bs * hkv, hq // hkv, width))


def _group_probs(logits: torch.Tensor) -> torch.Tensor:
    """``[rows, G, W]`` logits (``-inf`` where unusable) -> each cluster's softmax probability summed
    over the group's G query heads, ``-inf`` where unusable (a row with nothing usable stays all ``-inf``)."""
    lse = torch.logsumexp(logits, dim=2, keepdim=True)
    p = torch.exp(logits - torch.where(lse.isinf(), torch.zeros_like(lse), lse)).sum(dim=1)
    return p.masked_fill(logits[:, 0] == NEG, NEG)


@triton.jit
def _logits_kernel(q, cent, sizes, req_to_token, req_pool_indices, seq_lens, seg_valid, out, stride_qb, stride_qh,
                   stride_r2t, stride_valid, width, scale, BASE: tl.constexpr, SEG: tl.constexpr, PAGE: tl.constexpr,
                   RECENT: tl.constexpr, MIN_SEG: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   D: tl.constexpr, BLOCK: tl.constexpr, NPROG: tl.constexpr):
    """Grid (request x KV head, NPROG): ``out[rh, g, c]`` = ``q_g . centroid_c * scale`` for the row's
    usable clusters, ``-inf`` for the rest; program ``pid`` takes cluster blocks ``pid, pid + NPROG, ...``
    up to the row's usable width, then fills its blocks of the rest with ``-inf``."""
    rh = tl.program_id(0)
    pid = tl.program_id(1)
    i = rh // HKV
    h = rh % HKV
    n = tl.load(seq_lens + i)
    nseg = tl.maximum(n - RECENT - BASE, 0) // SEG
    nseg = tl.where(nseg >= MIN_SEG, nseg, 0)
    C: tl.constexpr = SEG // PAGE
    used = nseg * C
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    d = tl.arange(0, D)
    out_row = out + rh.to(tl.int64) * G * width
    for blk in range(pid, tl.cdiv(used, BLOCK), NPROG):
        c = blk * BLOCK + tl.arange(0, BLOCK)
        ok = c < used
        ok = ok & (tl.load(seg_valid + i * stride_valid + c // C, mask=ok, other=0) != 0)
        pos = BASE + (c // C) * SEG + (c % C) * PAGE
        page = tl.load(row_ptr + pos, mask=ok, other=0).to(tl.int64) // PAGE
        size = tl.load(sizes + page * HKV + h, mask=ok, other=0)
        ok = ok & (size > 0)
        ct = tl.load(cent + (page * HKV + h)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            qg = tl.load(q + i * stride_qb + (h * G + g) * stride_qh + d).to(tl.float32)
            s = tl.sum(ct * qg[None, :], axis=1) * scale
            tl.store(out_row + g * width + c, tl.where(ok, s, float("-inf")), mask=c < width)
    for blk in range(tl.cdiv(used, BLOCK) + pid, tl.cdiv(width, BLOCK), NPROG):
        c = blk * BLOCK + tl.arange(0, BLOCK)
        for g in tl.static_range(G):
            tl.store(out_row + g * width + c, tl.full([BLOCK], float("-inf"), tl.float32), mask=c < width)


LOGIT_BLOCK = 64
LOGIT_PROGRAMS = 32
DECODE_SPLITS = 16  # per (request, KV head): 6 x 8 heads x 16 = 768 programs at 130K x 6


def cluster_logits(q: torch.Tensor, store: IndexStore, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   seq_lens: torch.Tensor, seg_valid: torch.Tensor, layout: Layout, scale: float,
                   max_segments: int) -> torch.Tensor:
    """``[bs * Hkv, G, max_segments * C]`` fp32: ``q_g . centroid * scale`` of each usable cluster, ``-inf`` for the
    rest, the centroids read in place by a Triton kernel."""
    bs, hq, d = q.shape
    hkv = store.centroids.shape[1]
    g = hq // hkv
    width = max_segments * layout.clusters_per_segment
    logits = torch.empty(bs * hkv, g, width, dtype=torch.float32, device=q.device)
    if bs == 0:
        return logits
    assert d & (d - 1) == 0 and q.stride(2) == 1 and seg_valid.stride(1) == 1
    nprog = min(LOGIT_PROGRAMS, triton.cdiv(width, LOGIT_BLOCK))
    _logits_kernel[(bs * hkv, nprog)](
        q, store.centroids, store.sizes, req_to_token, req_pool_indices, seq_lens, seg_valid, logits, q.stride(0),
        q.stride(1), req_to_token.stride(0), seg_valid.stride(0), width, scale, BASE=layout.base, SEG=layout.seg,
        PAGE=layout.page, RECENT=layout.recent, MIN_SEG=layout.min_segments, HKV=hkv, G=g, D=d, BLOCK=LOGIT_BLOCK,
        NPROG=nprog)
    return logits


def cluster_scores(q: torch.Tensor, store: IndexStore, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   seq_lens: torch.Tensor, seg_valid: torch.Tensor, layout: Layout, scale: float,
                   max_segments: int) -> torch.Tensor:
    """:func:`cluster_scores_torch` in two Triton kernels: :func:`cluster_logits`, then :func:`group_probs` (each
    query head's softmax over them, summed over the group)."""
    return group_probs(cluster_logits(q, store, req_to_token, req_pool_indices, seq_lens, seg_valid, layout, scale,
                                      max_segments))


@triton.jit
def _group_probs_kernel(logits, out, width, G: tl.constexpr, GP: tl.constexpr, CHUNK: tl.constexpr):
    """One program per row: each query head's log-sum-exp over the row (online, chunk by chunk), then every
    cluster's probabilities summed over the group; ``-inf`` where the first head's logit is."""
    r = tl.program_id(0)
    base = logits + r.to(tl.int64) * G * width
    gi = tl.arange(0, GP)
    gm = gi < G
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    for start in range(0, width, CHUNK):
        c = start + tl.arange(0, CHUNK)
        x = tl.load(base + gi[:, None] * width + c[None, :], mask=gm[:, None] & (c < width)[None, :],
                    other=float("-inf"))
        new = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(new == float("-inf"), 0.0, new)
        den = den * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        m = new
    lse = tl.where(m == float("-inf"), 0.0, m + tl.log(den))  # a row with nothing usable: as torch's, 0
    for start in range(0, width, CHUNK):
        c = start + tl.arange(0, CHUNK)
        x = tl.load(base + gi[:, None] * width + c[None, :], mask=gm[:, None] & (c < width)[None, :],
                    other=float("-inf"))
        p = tl.sum(tl.exp(x - lse[:, None]), axis=0)
        first = tl.max(tl.where((gi == 0)[:, None], x, float("-inf")), axis=0)
        tl.store(out + r.to(tl.int64) * width + c, tl.where(first == float("-inf"), float("-inf"), p), mask=c < width)


GROUP_CHUNK = 1024


def group_probs(logits: torch.Tensor) -> torch.Tensor:
    """:func:`_group_probs` as one Triton program per row (torch's form is a dozen kernels a layer)."""
    rows, g, width = logits.shape
    out = torch.empty(rows, width, dtype=torch.float32, device=logits.device)
    if rows == 0 or width == 0:
        return out
    assert logits.is_contiguous()
    _group_probs_kernel[(rows,)](logits, out, width, G=g, GP=max(2, triton.next_power_of_2(g)), CHUNK=GROUP_CHUNK)
    return out


def rank_clusters(scores: torch.Tensor, width: int) -> torch.Tensor:
    """The best ``width`` clusters of each row, best first (``[rows, width]`` int32, ``-1`` past the
    row's usable clusters). Static shapes, no host sync."""
    k = min(width, scores.shape[1])
    vals, idx = torch.topk(scores, k, dim=1, sorted=True)
    idx = torch.where(vals == NEG, torch.full_like(idx, -1), idx).to(torch.int32)
    if k < width:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], width - k), -1)], dim=1)
    return idx


@triton.jit
def _write_tiers(out_row, keys, start, n, t1, need1, t2, need2, r, k, c1, c2, ties1, ties2, BLOCK: tl.constexpr):
    """Positions ``start..start + BLOCK`` of the row: the retrieved tier's (the ``r`` best: above ``t1`` or among
    the first ``need1`` ties) written from 0, the estimated tier's (the next: in the ``r + e`` best by ``t2`` /
    ``need2``, not retrieved) from ``r``, each after what earlier blocks wrote (``c1``, ``c2``)."""
    offs = start + tl.arange(0, BLOCK)
    take1, ties1 = _taken(keys, offs, n, t1, need1, ties1)
    take2, ties2 = _taken(keys, offs, n, t2, need2, ties2)
    est = take2 & ~take1
    dst1 = tl.cumsum(take1.to(tl.int32), axis=0) - 1 + c1
    tl.store(out_row + dst1, offs.to(tl.int32), mask=take1 & (dst1 < k))
    dst2 = r + tl.cumsum(est.to(tl.int32), axis=0) - 1 + c2
    tl.store(out_row + dst2, offs.to(tl.int32), mask=est & (dst2 < k))
    return c1 + tl.sum(take1.to(tl.int32), axis=0), c2 + tl.sum(est.to(tl.int32), axis=0), ties1, ties2


@triton.jit
def _tiers_kernel(scores, retrieved, estimated, out, width, stride_s, k, HKV: tl.constexpr, BLOCK: tl.constexpr,
                  ONE_BLOCK: tl.constexpr, TAIL: tl.constexpr, FILL: tl.constexpr):
    """One program per (request, KV head) row: the thresholds of its ``r`` and ``r + e`` best clusters, then both
    tiers written in position order (no sort), ``-1`` in the rest."""
    rh = tl.program_id(0)
    i = rh // HKV
    row = scores + rh.to(tl.int64) * stride_s
    out_row = out + rh.to(tl.int64) * k
    r = tl.load(retrieved + i)
    e = tl.load(estimated + i)
    keys, tkeys = _row_keys(row, width, BLOCK, ONE_BLOCK, TAIL)
    t1, need1, m = _kth_key(row, width, keys, tkeys, r, BLOCK, ONE_BLOCK, TAIL)
    t2, need2, m = _kth_key(row, width, keys, tkeys, r + e, BLOCK, ONE_BLOCK, TAIL)
    c1 = r * 0
    c2 = r * 0
    ties1 = r * 0
    ties2 = r * 0
    if ONE_BLOCK:
        c1, c2, ties1, ties2 = _write_tiers(out_row, keys, 0, width, t1, need1, t2, need2, r, k, c1, c2, ties1,
                                            ties2, BLOCK)
        if TAIL > 0:
            c1, c2, ties1, ties2 = _write_tiers(out_row, tkeys, BLOCK, width, t1, need1, t2, need2, r, k, c1, c2,
                                                ties1, ties2, TAIL)
    else:
        for start in range(0, width, BLOCK):
            c1, c2, ties1, ties2 = _write_tiers(out_row, _keys(row, start, width, BLOCK), start, width, t1, need1, t2,
                                                need2, r, k, c1, c2, ties1, ties2, BLOCK)
    for start in range(0, k, FILL):
        offs = start + tl.arange(0, FILL)
        unused = ((offs >= c1) & (offs < r)) | (offs >= r + c2)
        tl.store(out_row + offs, tl.full((FILL,), -1, tl.int32), mask=unused & (offs < k))


def rank_clusters_triton(scores: torch.Tensor, width: int, retrieved: torch.Tensor, estimated: torch.Tensor,
                         rows_per_request: int) -> torch.Tensor:
    """:func:`rank_clusters` for what the decode reads of it: per row the ``retrieved[i]`` best clusters in
    ``[:r]`` and the next ``estimated[i]`` in ``[r:r + e]``, each tier in position order rather than best first
    (the decode sums over a tier; the same sets as :func:`rank_clusters` when no score ties across a tier's
    edge, earliest positions first on ties), ``-1`` in the rest. Two thresholds by bisection as
    :func:`sgl_sparse.kernels.pages.select_pages_triton` (``torch.topk`` sorted ~2,000 of ~8,000 clusters a
    row at 130K). Static shapes, no host sync."""
    rows, n = scores.shape
    out = torch.empty(rows, width, dtype=torch.int32, device=scores.device)
    if rows == 0 or width == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    scores = scores.contiguous()
    _tiers_kernel[(rows,)](scores, retrieved, estimated, out, n, scores.stride(0), width, HKV=rows_per_request,
                           FILL=min(1024, triton.next_power_of_2(width)), **row_blocks(n))
    return out


def row_budgets(seq_lens: torch.Tensor, seg_valid: torch.Tensor, layout: Layout,
                max_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[bs]`` retrieved and estimated cluster counts from each row's usable segments."""
    nseg = layout.num_segments(seq_lens.long())
    k = torch.arange(max_segments, device=seq_lens.device)
    usable = ((k[None, :] < nseg[:, None]) & seg_valid[:, :max_segments].bool()).sum(dim=1)
    return layout.budgets(usable * layout.clusters_per_segment)


# -- attention --------------------------------------------------------------------------------------
def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, store: IndexStore,
                           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           seg_valid: torch.Tensor, ranked: torch.Tensor, retrieved: torch.Tensor,
                           estimated: torch.Tensor, layout: Layout, scale: float) -> torch.Tensor:
    """The decode output ``[bs, Hq, D]`` (q's dtype) as the module docstring defines it, one request at
    a time, every KV head at once: a mask of the positions read exactly, plus the estimated clusters
    as weighted pseudo-tokens (the reference and the CPU path). ``ranked`` ``[bs * Hkv, K]`` from
    :func:`rank_clusters`, ``retrieved``/``estimated`` ``[bs]`` from :func:`row_budgets`."""
    bs, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    c = layout.clusters_per_segment
    out = torch.empty_like(q)
    nseg = layout.num_segments(seq_lens.long()).tolist()
    dev = q.device
    heads = torch.arange(hkv, device=dev)
    for i in range(bs):
        n = int(seq_lens[i])
        row = req_to_token[int(req_pool_indices[i]), :n].long()
        pos = torch.arange(n, device=dev)
        seg = torch.div(pos - layout.base, layout.seg, rounding_mode="floor")
        usable = (pos >= layout.base) & (seg < nseg[i])
        if nseg[i]:
            usable &= seg_valid[i, seg.clamp(0, nseg[i] - 1)].bool()
        read = (~usable)[None, :].repeat(hkv, 1)  # [Hkv, n]
        r, e = int(retrieved[i]), int(estimated[i])
        ids = ranked[i * hkv:(i + 1) * hkv, : r + e].long()  # [Hkv, r + e]
        ok = ids >= 0
        cid = ids.clamp(min=0)
        start = layout.base + (cid // c) * layout.seg
        page = row[(start + (cid % c) * layout.page).clamp(max=max(n - 1, 0))] // layout.page  # [Hkv, r + e]
        hh = heads[:, None].expand_as(cid)
        size = store.sizes[page, hh]
        if r:
            off, sz, st = store.offsets[page[:, :r], hh[:, :r]].long(), size[:, :r].long(), start[:, :r]
            width = int(sz.max()) if sz.numel() else 0
            t = torch.arange(width, device=dev)
            m = (t[None, None, :] < sz[:, :, None]) & ok[:, :r, None]
            at = (st[:, :, None] + off[:, :, None] + t[None, None, :]).clamp(max=n - 1)
            local = store.order[row[at], hh[:, :r, None].expand_as(at)].long()
            member = (st[:, :, None] + local).clamp(max=n - 1)
            read[hh[:, :r, None].expand_as(member)[m], member[m]] = True
        slots = row
        kk = k_cache[slots].to(torch.float32).transpose(0, 1)  # [Hkv, n, D]
        vv = v_cache[slots].to(torch.float32).transpose(0, 1)
        qq = q[i].to(torch.float32).view(hkv, g, d)
        logits = torch.einsum("hgd,hnd->hgn", qq, kk) * scale
        logits = logits.masked_fill(~read[:, None, :], NEG)
        vals = vv[:, None].expand(hkv, g, n, d)
        if e:
            ep, es = page[:, r:], size[:, r:].to(torch.float32)
            eok = ok[:, r:] & (es > 0)
            cent = store.centroids[ep, hh[:, r:]].to(torch.float32)  # [Hkv, e, D]
            vs = store.value_sums[ep, hh[:, r:]].to(torch.float32)
            el = torch.einsum("hgd,hed->hge", qq, cent) * scale + torch.log(es.clamp(min=1))[:, None, :]
            el = el.masked_fill(~eok[:, None, :], NEG)
            logits = torch.cat([logits, el], dim=2)
            vals = torch.cat([vals, (vs / es.clamp(min=1)[:, :, None])[:, None].expand(hkv, g, e, d)], dim=2)
        w = torch.softmax(logits, dim=2)
        out[i] = torch.einsum("hgn,hgnd->hgd", w, vals).reshape(hq, d).to(q.dtype)
    return out


@triton.jit
def _exact_block(pos, mask, row_ptr, k_cache, v_cache, qv, h, m, den, acc, stride_ks, stride_kh, scale,
                 D: tl.constexpr):
    slot = tl.load(row_ptr + pos, mask=mask, other=0).to(tl.int64)
    d = tl.arange(0, D)
    k = tl.load(k_cache + slot[:, None] * stride_ks + h * stride_kh + d[None, :], mask=mask[:, None], other=0.0)
    v = tl.load(v_cache + slot[:, None] * stride_ks + h * stride_kh + d[None, :], mask=mask[:, None], other=0.0)
    s = tl.dot(qv, tl.trans(k.to(tl.float32))) * scale
    s = tl.where(mask[None, :], s, float("-inf"))
    return _online(m, den, acc, s, v.to(tl.float32))


@triton.jit
def _decode_kernel(q, k_cache, v_cache, cent, vsum, sizes, offsets, order, req_to_token, req_pool_indices,
                   seq_lens, seg_valid, ranked, retrieved, estimated, ws_m, ws_l, ws_acc, stride_qb, stride_qh,
                   stride_ks, stride_kh, stride_r2t, stride_valid, stride_rank, scale, BASE: tl.constexpr,
                   SEG: tl.constexpr, PAGE: tl.constexpr, RECENT: tl.constexpr, MIN_SEG: tl.constexpr,
                   HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   BLOCK: tl.constexpr, EBLOCK: tl.constexpr, NSPLIT: tl.constexpr, VBLOCK: tl.constexpr):
    """Grid (request x KV head, NSPLIT): split ``pid`` takes every NSPLIT-th block of each kind of read
    (sink, tail, unusable segments, retrieved clusters, estimated clusters) and writes its partial
    softmax state (max, sum, weighted values) to the workspace; :func:`decode_attention` merges."""
    rh = tl.program_id(0)
    pid = tl.program_id(1)
    i = rh // HKV
    h = rh % HKV
    n = tl.load(seq_lens + i)
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    d = tl.arange(0, D)
    gi = tl.arange(0, GP)
    gm = gi < G
    qv = tl.load(q + i * stride_qb + (h * G + gi)[:, None] * stride_qh + d[None, :], mask=gm[:, None],
                 other=0.0).to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    nseg = tl.maximum(n - RECENT - BASE, 0) // SEG
    nseg = tl.where(nseg >= MIN_SEG, nseg, 0)
    # Exact: the sink [0, BASE), the tail from the last segment's end, and unusable segments.
    for b in range(pid, tl.cdiv(tl.minimum(n, BASE), BLOCK), NSPLIT):
        pos = b * BLOCK + tl.arange(0, BLOCK)
        m, den, acc = _exact_block(pos, pos < tl.minimum(n, BASE), row_ptr, k_cache, v_cache, qv, h, m, den, acc,
                                 stride_ks, stride_kh, scale, D)
    tail = BASE + nseg * SEG
    for b in range(pid, tl.cdiv(tl.maximum(n - tail, 0), BLOCK), NSPLIT):
        pos = tail + b * BLOCK + tl.arange(0, BLOCK)
        m, den, acc = _exact_block(pos, pos < n, row_ptr, k_cache, v_cache, qv, h, m, den, acc, stride_ks,
                                 stride_kh, scale, D)
    # Names assigned under an `if` must not reuse an outer name of another type (Triton's compiler
    # rejects an int64 `b` redefined as int32, or the loop's `s` re-used for scores), hence sg / sb / spos / cb.
    # One vector pass counts them first: a loop of one scalar load a segment (127 at 130K) in every program
    # is serial latency where, as almost always, every segment is usable.
    unusable = nseg * 0
    for sv0 in range(0, nseg, VBLOCK):
        sv = sv0 + tl.arange(0, VBLOCK)
        unusable += tl.sum((tl.load(seg_valid + i * stride_valid + sv, mask=sv < nseg, other=1) == 0).to(tl.int32),
                           axis=0)
    for sg in range(0, tl.where(unusable > 0, nseg, 0)):
        if tl.load(seg_valid + i * stride_valid + sg) == 0:
            for sb in range(pid, SEG // BLOCK, NSPLIT):
                spos = BASE + sg * SEG + sb * BLOCK + tl.arange(0, BLOCK)
                m, den, acc = _exact_block(spos, spos < n, row_ptr, k_cache, v_cache, qv, h, m, den, acc, stride_ks,
                                         stride_kh, scale, D)
    # Retrieved clusters: their members, exactly.
    r = tl.load(retrieved + i)
    e = tl.load(estimated + i)
    rank_row = ranked + rh.to(tl.int64) * stride_rank
    C: tl.constexpr = SEG // PAGE
    for j in range(pid, r, NSPLIT):
        cid = tl.load(rank_row + j)
        if cid >= 0:
            start = BASE + (cid // C) * SEG
            page = tl.load(row_ptr + start + (cid % C) * PAGE).to(tl.int64) // PAGE
            off = tl.minimum(tl.maximum(tl.load(offsets + page * HKV + h), 0), SEG)
            size = tl.minimum(tl.load(sizes + page * HKV + h), SEG - off)
            for cb in range(0, tl.cdiv(size, BLOCK)):
                t = cb * BLOCK + tl.arange(0, BLOCK)
                tm = t < size
                slot_t = tl.load(row_ptr + start + off + t, mask=tm, other=0).to(tl.int64)
                local = tl.load(order + slot_t * HKV + h, mask=tm, other=0).to(tl.int64)
                local = tl.minimum(tl.maximum(local, 0), SEG - 1)  # a torn write never reads outside
                m, den, acc = _exact_block(start + local, tm, row_ptr, k_cache, v_cache, qv, h, m, den, acc,
                                         stride_ks, stride_kh, scale, D)
    # Estimated clusters: exp(q . centroid) weighs the value sum, and the size in the denominator.
    for b in range(pid, tl.cdiv(e, EBLOCK), NSPLIT):
        jr = r + b * EBLOCK + tl.arange(0, EBLOCK)
        cid = tl.load(rank_row + jr, mask=jr < r + e, other=-1)
        ok = cid >= 0
        cs = tl.where(ok, cid, 0)
        start = BASE + (cs // C) * SEG
        page = tl.load(row_ptr + start + (cs % C) * PAGE, mask=ok, other=0).to(tl.int64) // PAGE
        size = tl.load(sizes + page * HKV + h, mask=ok, other=0).to(tl.float32)
        ok = ok & (size > 0)
        ct = tl.load(cent + (page * HKV + h)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        vs = tl.load(vsum + (page * HKV + h)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(qv, tl.trans(ct)) * scale + tl.log(tl.where(ok, size, 1.0))[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m, den, acc = _online(m, den, acc, s, vs / tl.where(ok, size, 1.0)[:, None])
    store_split(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, D)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, store: IndexStore,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     seg_valid: torch.Tensor, ranked: torch.Tensor, retrieved: torch.Tensor, estimated: torch.Tensor,
                     layout: Layout, scale: float, splits: int = DECODE_SPLITS) -> torch.Tensor:
    """:func:`decode_attention_torch` as one Triton kernel over the batch (grid: request x KV head x
    ``splits``: a batch of a few long requests still fills the GPU), then the splits' merge."""
    bs, hq, d = q.shape
    hkv = k_cache.shape[1]
    if bs == 0:
        return torch.empty_like(q)
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    assert k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride() and q.stride(2) == 1
    assert layout.seg % 16 == 0 and layout.base % layout.page == 0
    g = hq // hkv
    ws_m, ws_l, ws_acc = split_workspace(bs * hkv, splits, g, d, q.device)
    _decode_kernel[(bs * hkv, splits)](
        q, k_cache, v_cache, store.centroids, store.value_sums, store.sizes, store.offsets, store.order,
        req_to_token, req_pool_indices, seq_lens, seg_valid, ranked, retrieved, estimated, ws_m, ws_l, ws_acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0), seg_valid.stride(0),
        ranked.stride(0), scale, BASE=layout.base, SEG=layout.seg, PAGE=layout.page, RECENT=layout.recent,
        MIN_SEG=layout.min_segments, HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK=16,
        EBLOCK=16, NSPLIT=splits, VBLOCK=128)
    return merge_splits(ws_m, ws_l, ws_acc, bs, q.dtype)


def index_bytes_per_token(page: int, hkv: int, d: int, dtype: torch.dtype, layers: int) -> int:
    """Device bytes of :class:`IndexStore` per KV token over all layers (rounded up)."""
    return math.ceil(IndexStore.bytes_per_token(page, hkv, d, dtype) * layers)
