"""Attention over a method-owned KV layout (:class:`sgl_sparse.contract.KVStore`), for every base.

* Decode: the store encodes this step's K/V (:meth:`~sgl_sparse.contract.KVStore.write`, with each
  token's row), then its :meth:`~sgl_sparse.contract.KVStore.decode` reads each row through
  ``req_to_token`` (device only: CUDA-graph safe).
* Extend: the new tokens attend to each other as the store serves them
  (:meth:`~sgl_sparse.contract.KVStore.round_trip`; causal; FlashInfer's ragged prefill on the GPU, plain torch
  on CPU), their queries attend to the cached prefix through the store's
  :meth:`~sgl_sparse.contract.KVStore.prefix`, and the two parts are merged by their log-sum-exp, as
  SGLang's own ragged + paged extend does; then the new K/V is stored. The rows' offsets and each new
  token's row are computed once per forward (sizes from the host: no sync). Reading the new keys as stored, not
  at full precision, is what makes a prompt's answer independent of where its prefill chunks end (other traffic
  moves them): each key is read the same way by every query after it.
* A grouped store (page size G > 1, KIVI): a query reads the whole pages before its own as stored and its own
  page at full precision (its page as stored when it is the page's last position), as a decode step at its
  position does. The prefix part reads the cached prefix's whole pages; the tokens of the page it ends
  in (the store's open group, :meth:`~sgl_sparse.contract.KVStore.read_open`) join the new tokens in a transient
  page-aligned buffer (:class:`OpenPages`), each page at full precision and as stored, which the new tokens'
  queries read page by page: FlashInfer's paged prefill on the GPU (one request per page of queries, its pages
  before it as stored, its own at full precision, causal), plain torch on CPU.
* A store that reads its prefix dequantized (:attr:`~sgl_sparse.contract.KVStore.dequantize_prefix`): the
  step's prefix slots are listed flat once per forward (:func:`dense_prefix`), each layer dequantizes them
  (:meth:`~sgl_sparse.contract.KVStore.read_prefix`) and the base's dense prefill attends them (FlashInfer's ragged
  prefill, non-causal, on the GPU; plain torch on CPU), merged as above.
* Under an evicting method (a composition) rows hold sentinel slots at evicted positions, so the store reads
  compacted rows instead (:func:`compact_rows`, once per forward): each request's live slots in position
  order, packed to the front, its row the request's index in the batch, its length the live count. The
  store never sees a sentinel and nothing moves in the pool. The CPU server's path (the launcher refuses a
  composition on CUDA: the table is built per step with a sort over each row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import KVStore
from sgl_sparse.slots import SENTINEL_SLOT
from sgl_sparse.store_reads import attend

LN2 = math.log(2.0)


@dataclass
class StoreRows:
    """The rows a store reads (``req_to_token`` or a compacted table), which of them belong to the batch, in
    batch order, and how many positions of each it reads."""

    table: torch.Tensor
    indices: torch.Tensor
    lens: torch.Tensor


def compact_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor,
                 width: int) -> StoreRows:
    """The live slots among the first ``lens[i]`` positions of each row ``req_to_token[req_pool_indices[i]]``,
    in position order, packed to the front of row ``i`` of a ``[bs, width]`` table (``width`` >= every length);
    their counts are the lengths."""
    bs = req_pool_indices.shape[0]
    device = req_to_token.device
    rows = req_to_token[req_pool_indices.long(), :width]
    live = (rows != SENTINEL_SLOT) & (torch.arange(width, device=device)[None, :] < lens.to(device)[:, None])
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)  # live first, each part in position order
    return StoreRows(rows.gather(1, order), torch.arange(bs, device=device), live.sum(1).to(lens.dtype))


def flat_rows(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, bs: int, width: int) -> StoreRows:
    """The rows of a decode step's compacted KV lists (FlashInfer's ``kv_indptr`` / ``kv_indices``: each request's
    live slots, flat), as the stores' Triton decode kernels read rows, on the device and CUDA-graph safe (the lists
    are the graph's static buffers). A kernel reads slot ``table[row] + pos`` through ``table.stride(0)``, so the
    flat list viewed with row stride 1 and each request's row index its list's start reads exactly its list;
    ``table.shape[1]`` (what the kernels size their splits from) is ``width``, capped by the list's length. For
    Triton kernels only: a torch path would index rows past the view's shape."""
    w = max(1, min(width, kv_indices.numel()))
    table = kv_indices.as_strided((1, w), (1, 1))
    starts = kv_indptr[:bs]
    return StoreRows(table, starts, kv_indptr[1:bs + 1] - starts)


def raw_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor) -> StoreRows:
    return StoreRows(req_to_token, req_pool_indices, lens)


# The most prefix tokens one extend step reads dequantized (a store's ``dequantize_prefix``): the transient K/V
# buffer of one layer's call is this x 4 bytes x KV heads x head dim (1 GiB for Llama-3-8B's 8 x 128), outside
# SGLang's KV budget (it comes from the activations' share), plus the store's own temporaries (one piece of
# store_reads.READ_PIECE slots at a time by default). A step over more reads its prefix through the store's kernel.
DEQUANTIZE_MAX_TOKENS = 262_144


@dataclass
class DensePrefix:
    """An extend step's cached prefixes as one flat list of slots, request after request in position order (what
    :meth:`KVStore.read` dequantizes for the base's dense prefill). ``lens``: each request's count (0: no prefix).
    The base's prefill runs over the requests with a prefix only: ``q_rows`` their new tokens' rows (device; ``None``
    when every request has one), ``qo_indptr`` and ``kv_indptr`` ``[m + 1]`` int32 over those ``m`` requests on the
    host (a plan made from them needs no device sync)."""

    slots: torch.Tensor
    lens: list[int]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    q_rows: torch.Tensor | None = None


def _indptr(counts: list[int]) -> torch.Tensor:
    out = torch.zeros(len(counts) + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return out


def dense_prefix(prefix: StoreRows, lens: list[int], extend_lens: list[int] | None = None) -> DensePrefix:
    """The slots of the first ``lens[i]`` positions of each row of ``prefix``, flattened (device only), and the
    prefill's view of the requests with a prefix (``extend_lens``: each request's new tokens; default one each)."""
    device = prefix.table.device
    extend_lens = [1] * len(lens) if extend_lens is None else extend_lens
    bs, total = len(lens), sum(lens)
    host = _indptr(lens)
    indptr = host.to(device, non_blocking=True)
    counts = indptr[1:] - indptr[:-1]
    req = torch.repeat_interleave(torch.arange(bs, device=device), counts, output_size=total)
    pos = torch.arange(total, device=device) - indptr[req]
    slots = prefix.table[prefix.indices.to(torch.int64)[req], pos].to(torch.int64)
    some = [i for i, n in enumerate(lens) if n > 0]
    q_rows = None
    if len(some) < bs:
        starts = _indptr(extend_lens)
        q_rows = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in some]).to(device,
                                                                                                  non_blocking=True)
    return DensePrefix(slots, lens, _indptr([extend_lens[i] for i in some]).to(torch.int32),
                       _indptr([lens[i] for i in some]).to(torch.int32), q_rows)


@dataclass
class OpenPages:
    """A grouped store's extend (page size ``group``): per request, the tokens of the page its cached prefix ends
    in (``open_lens[i]`` of them, from the store's open group) then its new tokens, laid out from page
    ``page_starts[i]`` of a transient ``[pages * group]`` buffer. ``new_dest``: each new token's place in it (device);
    ``open_rows`` / ``open_offsets`` / ``open_dest``: each open-group token's request row, offset and place.
    ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``last_page_len`` (host int32): the paged prefill over the buffer's
    pages viewed as [rounded pages, full-precision pages] (:func:`open_pages`)."""

    group: int
    pages: int
    open_lens: list[int]
    page_starts: list[int]
    new_dest: torch.Tensor
    open_rows: torch.Tensor
    open_offsets: torch.Tensor
    open_dest: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor


def open_pages(rows: torch.Tensor, prefix_lens: list[int], extend_lens: list[int], group: int) -> OpenPages:
    """The layout of :class:`OpenPages` for requests in rows ``rows`` (device), from host sizes only (once a forward,
    no sync).

    Page ``P``'s queries read the pages before it as stored and page ``P`` itself at full precision up to each
    query, except the query at the page's last position, which reads page ``P`` as stored too: what a decode step
    at each position reads (it writes first; the token that fills a page quantizes it). So the paged prefill gets
    one request for page ``P``'s other queries (kv: pages ``< P`` as stored, then page ``P`` at full precision, as
    long as the last of them) and, where the page is whole, one for its last query (kv: pages ``<= P`` as stored)."""
    new_dest, o_offs, o_dest, idx, last, qo_counts, kv_counts = [], [], [], [], [], [], []
    opens = [c % group for c in prefix_lens]
    counts = [-(-(o + n) // group) for o, n in zip(opens, extend_lens, strict=True)]  # pages per request
    total = sum(counts)  # page p as stored is page p of the buffer, at full precision page total + p
    starts = _indptr(counts)[:-1].tolist()
    for o, n, p, pages in zip(opens, extend_lens, counts, starts, strict=True):
        length, base = o + n, pages * group
        o_offs.append(torch.arange(o))
        o_dest.append(torch.arange(base, base + o))
        new_dest.append(torch.arange(base + o, base + length))
        for page in range(p):
            first, end = max(o, page * group), min(length, (page + 1) * group)
            whole = end == (page + 1) * group
            stored = list(range(pages, pages + page))
            if end - whole > first:  # the page's queries but a whole page's last: its tokens at full precision
                idx += [*stored, total + pages + page]
                qo_counts.append(end - whole - first)
                kv_counts.append(page + 1)
                last.append(end - whole - page * group)
            if whole:  # the last position of a whole page: the page as stored
                idx += [*stored, pages + page]
                qo_counts.append(1)
                kv_counts.append(page + 1)
                last.append(group)

    def dev(parts: list[torch.Tensor]) -> torch.Tensor:
        return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)).to(rows.device, non_blocking=True)

    o_rows = torch.repeat_interleave(rows.to(torch.int64), dev([torch.tensor(opens, dtype=torch.int64)]),
                                     output_size=sum(opens))
    return OpenPages(group, total, opens, starts, dev(new_dest), o_rows, dev(o_offs), dev(o_dest),
                     _indptr(qo_counts).to(torch.int32), _indptr(kv_counts).to(torch.int32),
                     torch.tensor(idx, dtype=torch.int32), torch.tensor(last, dtype=torch.int32))


def open_page_kv(store: KVStore, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                 pages: OpenPages) -> tuple[torch.Tensor, torch.Tensor]:
    """The transient buffer of :class:`OpenPages` for one layer: K and V ``[2 * pages * group, Hkv, D]`` each, the
    pages as stored, then the same pages at full precision (the layout the paged prefill reads; a partial last page
    padded with zeros, never read as stored)."""
    n = pages.pages * pages.group
    kb = k.new_zeros((2 * n, *k.shape[1:]))
    vb = v.new_zeros((2 * n, *v.shape[1:]))
    kf, vf = kb[n:], vb[n:]
    kf[pages.new_dest], vf[pages.new_dest] = k, v
    if pages.open_dest.numel():
        ko, vo = store.read_open(layer_id, pages.open_rows, pages.open_offsets)
        kf[pages.open_dest], vf[pages.open_dest] = ko.to(k.dtype), vo.to(v.dtype)
    kb[:n], vb[:n] = store.round_trip(layer_id, kf, vf)
    return kb, vb


def open_pages_attention_torch(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, pages: OpenPages,
                               extend_lens: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's new tokens over its :class:`OpenPages` buffer (:func:`open_page_kv`), fp32: a query reads the
    pages before its own as stored and its own page up to itself at full precision, or as stored when it is the
    page's last position -> (output, natural lse)."""
    n_buf = pages.pages * pages.group
    kr, kf, vr, vf = kb[:n_buf], kb[n_buf:], vb[:n_buf], vb[n_buf:]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    group, g = pages.group, q.shape[1] // kf.shape[1]
    at = 0
    for o, start, n in zip(pages.open_lens, pages.page_starts, extend_lens, strict=True):
        length = o + n
        base = start * group
        ks = torch.cat([kr[base:base + length], kf[base:base + length]]).float().repeat_interleave(g, dim=1)
        vs = torch.cat([vr[base:base + length], vf[base:base + length]]).float().repeat_interleave(g, dim=1)
        t = torch.arange(o, length, device=q.device)[:, None]  # each query's place in the buffer
        j = torch.arange(length, device=q.device)[None, :]
        own = t // group * group
        closes = t % group == group - 1  # the last position of its page: the page as stored, as decode reads it
        visible = torch.cat([(j < own) | (closes & (j <= t)), ~closes & (j >= own) & (j <= t)], dim=1)
        logits = torch.einsum("thd,shd->hts", q[at:at + n].float(), ks) * scale
        logits = logits.masked_fill(~visible[None], float("-inf"))
        lse[at:at + n] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        out[at:at + n] = torch.einsum("hts,shd->thd", torch.softmax(logits, dim=-1), vs).to(q.dtype)
        at += n
    return out, lse


@dataclass
class ExtendLists:
    """An extend step's rows: new tokens per row (``qo_indptr``, device; ``extend_lens``, host), the rows the
    store's prefix reads (``prefix``: each request's cached prefix), and each new token's row (``rows``, its
    ``req_pool_idx``, for the write). ``dense``: the prefix as flat slots when it is read dequantized this step."""

    qo_indptr: torch.Tensor
    prefix: StoreRows
    rows: torch.Tensor
    extend_lens: list[int]
    has_prefix: bool
    dense: DensePrefix | None = None
    open: OpenPages | None = None


def extend_lists(forward_batch: Any, req_to_token: torch.Tensor, compact: bool = False,
                 dequantize: bool = False, group: int = 1) -> ExtendLists:
    """``compact``: the prefix rows hold sentinels (an evicting method), read them compacted. ``dequantize``: the
    store reads its prefix dequantized (:attr:`KVStore.dequantize_prefix`): list its (live) slots flat when together
    they fit :data:`DEQUANTIZE_MAX_TOKENS` (requests without a prefix take no part: their rows' prefix part is empty,
    log-sum-exp ``-inf``); otherwise the step reads through the store's kernel. ``group``: the store's page size; a
    grouped store's prefix part reads whole pages only, the rest joins the new tokens (:class:`OpenPages`)."""
    device = req_to_token.device
    extend_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    bs = len(extend_lens)
    seq = forward_batch.extend_seq_lens.to(torch.int64)
    qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    qo_indptr[1:] = torch.cumsum(seq, 0)
    rows = torch.repeat_interleave(forward_batch.req_pool_indices.to(torch.int64), seq, output_size=sum(extend_lens))
    prefix_lens = forward_batch.extend_prefix_lens.to(torch.int32)
    lens = [int(n) for n in forward_batch.extend_prefix_lens_cpu]
    pages = None
    if group > 1:
        if compact:
            raise ValueError("a grouped store's extend does not read compacted rows (it serves no eviction)")
        pages = open_pages(forward_batch.req_pool_indices, lens, extend_lens, group)
        prefix_lens = prefix_lens - prefix_lens % group
        lens = [n - n % group for n in lens]
    longest = max(lens, default=0)
    prefix = (compact_rows(req_to_token, forward_batch.req_pool_indices, prefix_lens, longest) if compact
              else raw_rows(req_to_token, forward_batch.req_pool_indices, prefix_lens))
    dense = None
    if dequantize and longest > 0:
        # Compacted rows (an evicting method: a Chain Cache continuation's prefix holds sentinels) are read by
        # their live counts, which the host learns in one sync a step (extend steps only; decode never reads here).
        live = [int(n) for n in prefix.lens.tolist()] if compact else lens
        if max(live) > 0 and sum(live) <= DEQUANTIZE_MAX_TOKENS:
            dense = dense_prefix(prefix, live, extend_lens)
    return ExtendLists(qo_indptr, prefix, rows, extend_lens, longest > 0, dense, pages)


def decode_rows(forward_batch: Any, req_to_token: torch.Tensor, compact: bool = False) -> StoreRows:
    """The rows a decode step's store reads: the batch's own, or (``compact``) their live slots."""
    if not compact:
        return raw_rows(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens)
    longest = int(forward_batch.seq_lens_cpu.max()) if forward_batch.seq_lens_cpu is not None else req_to_token.shape[1]
    return compact_rows(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, longest)


def causal_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extend_lens: list[int],
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's new tokens over themselves, causal, fp32: (output ``[n, Hq, D]``, natural lse ``[n, Hq]``)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    at = 0
    for n in extend_lens:
        qs, ks, vs = q[at:at + n].float(), k[at:at + n].float(), v[at:at + n].float()
        logits = torch.einsum("thd,shd->hts", qs, ks.repeat_interleave(group, dim=1)) * scale
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
        lse[at:at + n] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        out[at:at + n] = torch.einsum("hts,shd->thd", torch.softmax(logits, dim=-1),
                                      vs.repeat_interleave(group, dim=1)).to(q.dtype)
        at += n
    return out, lse


def prefix_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extend_lens: list[int],
                           prefix_lens: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's new tokens over its whole prefix (no mask), fp32: ``q`` ``[n, Hq, D]``, ``k``/``v`` the prefixes
    flat (:class:`DensePrefix` order) -> (output ``[n, Hq, D]``, natural lse ``[n, Hq]``)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    at = kv = 0
    for n, m in zip(extend_lens, prefix_lens, strict=True):
        if m == 0:  # no prefix: an empty part of the joint softmax
            out[at:at + n], lse[at:at + n] = 0, float("-inf")
        else:
            out[at:at + n], lse[at:at + n] = attend(q[at:at + n], k[kv:kv + m], v[kv:kv + m], scale)
        at, kv = at + n, kv + m
    return out, lse


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Two attention parts over disjoint keys -> their joint softmax (``lse`` natural, ``-inf`` = empty part)."""
    top = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - top)[..., None]
    w2 = torch.exp(lse2 - top)[..., None]
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(o1.dtype)


def check_layer(layer: Any, store: KVStore) -> None:
    if getattr(layer, "is_cross_attention", False) or getattr(layer, "sliding_window_size", -1) not in (None, -1):
        raise ValueError(f"sgl_sparse: {type(store).__name__} serves full causal self-attention only (no cross "
                         "attention or sliding windows)")
    if str(getattr(layer, "attn_type", "")).endswith("ENCODER_ONLY"):
        raise ValueError(f"sgl_sparse: {type(store).__name__} serves causal decoders only (encoder-only layer)")
    if getattr(layer, "logit_cap", 0) not in (None, 0, 0.0):
        raise ValueError(f"sgl_sparse: {type(store).__name__} does not apply logit soft-capping")
    if getattr(layer, "k_scale_float", None) not in (None, 1.0) or getattr(layer, "v_scale_float", None) not in (
            None, 1.0):
        raise ValueError(f"sgl_sparse: checkpoint KV scales are not supported with {type(store).__name__} (its "
                         "scales are its own)")


def store_extend(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                 lists: ExtendLists, save_kv_cache: bool, new_tokens: Any, merge_fn: Any = merge,
                 dense_prefix_fn: Any = None, open_pages_fn: Any = None) -> torch.Tensor:
    """One layer's extend attention over ``backend``'s store pool; ``new_tokens(q3, k3, v3, layer, lists)`` is
    the base's causal attention of the new tokens (output, natural lse), ``merge_fn`` its merge of two parts,
    ``dense_prefix_fn(q3, k, v, layer, lists)`` its attention over the prefix dequantized (``lists.dense``),
    ``open_pages_fn(q3, kb, vb, layer, lists)`` its attention over a grouped store's :class:`OpenPages`."""
    store: KVStore = backend.token_to_kv_pool.store
    check_layer(layer, store)
    hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
    q3 = q.reshape(-1, hq, d).contiguous()
    k3, v3 = k.reshape(-1, hkv, d).contiguous(), v.reshape(-1, hkv, layer.v_head_dim).contiguous()
    if store.reads_back_new_tokens:
        # Each new token as the pool stores it, its encoding reading its request's earlier tokens (the cached
        # prefix's included): written first, then read back.
        if not save_kv_cache:
            raise RuntimeError(f"sgl_sparse: {type(store).__name__} reads an extend's new tokens back from the pool, "
                               "and this forward does not store them")
        store.write(layer.layer_id, forward_batch.out_cache_loc, k3, v3, lists.rows, decode=False,
                    positions=forward_batch.positions)
        save_kv_cache = False
        ks, vs = store.read(layer.layer_id, forward_batch.out_cache_loc)
        o, lse = new_tokens(q3, ks.to(k3.dtype), vs.to(v3.dtype), layer, lists)
    elif lists.open is not None:
        kb, vb = open_page_kv(store, layer.layer_id, k3, v3, lists.open)
        o, lse = open_pages_fn(q3, kb, vb, layer, lists)
    else:
        ks, vs = store.round_trip(layer.layer_id, k3, v3, forward_batch.positions)
        o, lse = new_tokens(q3, ks.to(k3.dtype), vs.to(v3.dtype), layer, lists)
    if lists.has_prefix:
        if lists.dense is not None:
            p = lists.prefix
            kp, vp = store.read_prefix(layer.layer_id, p.table, p.indices, p.lens, lists.dense.lens,
                                       lists.dense.slots)
            o2, lse2 = dense_prefix_fn(q3, kp, vp, layer, lists)
        else:
            p = lists.prefix
            o2, lse2 = store.prefix(layer.layer_id, q3, lists.qo_indptr, p.table, p.indices, p.lens,
                                    lists.extend_lens, float(layer.scaling))
        o = merge_fn(o, lse, o2, lse2)
    if save_kv_cache:
        store.write(layer.layer_id, forward_batch.out_cache_loc, k3, v3, lists.rows, decode=False,
                    positions=forward_batch.positions)
    return o.reshape(-1, hq * layer.v_head_dim)


def store_decode(backend: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                 rows: StoreRows, save_kv_cache: bool) -> torch.Tensor:
    """One layer's decode attention over ``backend``'s store pool, reading ``rows`` (:func:`decode_rows`)."""
    store: KVStore = backend.token_to_kv_pool.store
    check_layer(layer, store)
    hq, d = layer.tp_q_head_num, layer.qk_head_dim
    if save_kv_cache and k is not None:
        store.write(layer.layer_id, forward_batch.out_cache_loc, k.reshape(-1, layer.tp_k_head_num, d),
                    v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim), forward_batch.req_pool_indices, decode=True,
                    positions=forward_batch.positions)
    q3 = q.reshape(-1, hq, d)
    o = store.decode(layer.layer_id, q3, rows.table, rows.indices, rows.lens, float(layer.scaling))
    return o.reshape(-1, hq * layer.v_head_dim)
