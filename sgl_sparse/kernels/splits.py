"""Pieces shared by the attention kernels (FP8, KIVI, TurboQuant, RetroInfer): the online-softmax step, the
split-KV decode's per-split state (stored by each program, merged by one kernel), and the extend kernels' rows (a
block of query tokens x the group's heads) with their output and log-sum-exp. Reading KIVI's and TurboQuant's
packed codes: ``kernels/chunks.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def softmax_step(m, lse_sum, logits, AXIS: tl.constexpr = 1):
    """The online softmax's bookkeeping for ``logits`` ``[G, N]`` (``AXIS`` 0: ``[N, G]``, the keys as rows):
    (new max, new denominator, the probabilities as ``logits``, the factor ``[G]`` that rescales what was accumulated
    so far), for kernels that keep their output in several pieces (``kernels/chunks.py``) or transposed."""
    m_new = tl.maximum(m, tl.max(logits, AXIS))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(logits - tl.expand_dims(m_safe, AXIS))
    return m_new, lse_sum * alpha + tl.sum(p, AXIS), p, alpha


@triton.jit
def online_step(m, lse_sum, acc, logits, vals):
    """One online-softmax step: ``logits`` ``[G, N]``, ``vals`` ``[N, D]`` (fp32)."""
    m_new, den, p, alpha = softmax_step(m, lse_sum, logits)
    return m_new, den, acc * alpha[:, None] + tl.dot(p, vals)


@triton.jit
def online_step_weighted(m, lse_sum, acc, logits, vals, weights):
    """:func:`online_step` with each key's value row scaled by ``weights`` ``[N]``, applied to the
    probabilities (so ``vals`` may stay raw codes in bf16 for the tensor cores: the dot runs in their dtype)."""
    m_new, den, p, alpha = softmax_step(m, lse_sum, logits)
    return m_new, den, acc * alpha[:, None] + tl.dot((p * weights[None, :]).to(vals.dtype), vals)


@triton.jit
def split_span(seq_lens, HKV: tl.constexpr, BLOCK: tl.constexpr, NSPLIT: tl.constexpr):
    """A split-KV decode program (grid: request x KV head, ``NSPLIT``): its row ``rh``, split ``pid``, request
    ``i``, KV head ``h``, the request's length ``n`` and its share ``[lo, hi)`` of the positions, in whole
    ``BLOCK``s. Read from ``seq_lens`` on the device, so a CUDA graph captured at full width does no work
    past a row's real length."""
    rh = tl.program_id(0)
    pid = tl.program_id(1)
    i = rh // HKV
    n = tl.load(seq_lens + i)
    lo, hi = split_bounds(n, pid, BLOCK, NSPLIT)
    return rh, pid, i, rh % HKV, n, lo, hi


@triton.jit
def split_bounds(n, pid, BLOCK: tl.constexpr, NSPLIT: tl.constexpr):
    """Split ``pid``'s share ``[lo, hi)`` of a row's ``n`` positions (or list entries), in whole ``BLOCK``s."""
    per = tl.cdiv(tl.cdiv(n, NSPLIT), BLOCK) * BLOCK
    lo = pid * per
    return lo, tl.minimum(lo + per, n)


@triton.jit
def workspace_span(prefix_lens, ws_start, BLOCK: tl.constexpr):
    """A prefix-dequantizing program (grid: request x KV head x position block, one pass of
    :func:`prefix_passes`): request ``i``, KV head ``h``, the prefix length ``n``, the request's first workspace
    row ``base`` (``-1``: not in this pass), the block's positions and which of them it writes."""
    i = tl.program_id(0)
    n = tl.load(prefix_lens + i)
    base = tl.load(ws_start + i).to(tl.int64)
    pos = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    return i, tl.program_id(1), n, base, pos, (pos < n) & (base >= 0)


@triton.jit
def group_queries(q, i, h, stride_qb, stride_qh, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """Request ``i``'s queries of KV head ``h``'s group, ``[GP, D]`` fp32 (the rows past ``G`` are 0)."""
    gi = tl.arange(0, GP)
    d = tl.arange(0, D)
    return tl.load(q + i * stride_qb + (h * G + gi)[:, None] * stride_qh + d[None, :], mask=(gi < G)[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def store_split(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT: tl.constexpr, G: tl.constexpr,
                GP: tl.constexpr, D: tl.constexpr):
    """A decode program's state (row ``rh`` = request x KV head, split ``pid``) into :func:`split_workspace`."""
    gi = tl.arange(0, GP)
    gm = gi < G
    w = (rh.to(tl.int64) * NSPLIT + pid) * G
    tl.store(ws_m + w + gi, m, mask=gm)
    tl.store(ws_l + w + gi, den, mask=gm)
    tl.store(ws_acc + (w + gi)[:, None] * D + tl.arange(0, D)[None, :], acc, mask=gm[:, None])


# Decode splits (programs per request x KV head): at least the 16 the kernels always had; more when rows are wide
# and the batch is small, so that a program covers ~SPLIT_SPAN positions of a full-width row (6 x 130K at 16
# splits gave each program 8K positions, a long serial loop with ~800 programs on 132 SMs); at most what keeps
# the grid near SPLIT_PROGRAMS programs (each split stores G x D fp32 of state, read back by the merge).
MIN_SPLITS, MAX_SPLITS, SPLIT_SPAN, SPLIT_PROGRAMS = 16, 64, 2048, 4096


def decode_splits(rows: int, width: int) -> int:
    """Splits for ``rows`` (requests x KV heads) over rows ``width`` positions wide (``req_to_token.shape[1]``):
    from static shapes only, so a CUDA graph captured once keeps its grid; ``split_span`` bounds each program by
    the real ``seq_lens``, and a split past a short row's end stores an empty state (max ``-inf``, weight 0)."""
    want = min(triton.cdiv(width, SPLIT_SPAN), triton.cdiv(SPLIT_PROGRAMS, max(rows, 1)), MAX_SPLITS)
    return max(MIN_SPLITS, want)


def split_workspace(rows: int, splits: int, group: int, d: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Running max, denominator ``[rows, splits, group]`` and unnormalized output ``[..., d]``, fp32."""
    ws_m = torch.empty(rows, splits, group, dtype=torch.float32, device=device)
    return ws_m, torch.empty_like(ws_m), torch.empty(rows, splits, group, d, dtype=torch.float32, device=device)


@triton.jit
def extend_rows(q, qo_indptr, blk_req, blk_start, stride_qt, stride_qh, G: tl.constexpr, GP: tl.constexpr,
                D: tl.constexpr, BLOCK_M: tl.constexpr):
    """An extend program's rows (block ``program_id(0)`` of ``BLOCK_M`` new tokens of request ``i``, KV head
    ``program_id(1)``, the group's query heads): (``i``, each row's token and query head, the row mask, ``q``
    of the rows ``[BLOCK_M * GP, D]`` as stored)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.load(blk_req + b)
    r = tl.arange(0, BLOCK_M * GP)
    tok = (tl.load(qo_indptr + i) + tl.load(blk_start + b) + r // GP).to(tl.int64)
    g = r % GP
    rm = (tok < tl.load(qo_indptr + i + 1)) & (g < G)
    head = h * G + g
    d = tl.arange(0, D)
    qv = tl.load(q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=rm[:, None], other=0.0)
    return i, tok, head, rm, qv


@triton.jit
def store_rows(out, lse, tok, head, rm, m, den, acc, stride_ot, stride_oh, HQ: tl.constexpr, D: tl.constexpr):
    """The rows' normalized output and natural log-sum-exp (``-inf`` where nothing was read)."""
    d = tl.arange(0, D)
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=rm[:, None])
    tl.store(lse + tok * HQ + head, tl.where(den > 0, m + tl.log(den), float("-inf")), mask=rm)


@triton.jit
def _merge_kernel(ws_m, ws_l, ws_acc, basis, out, stride_bg, stride_be, stride_br, stride_ob, stride_oh,
                  HKV: tl.constexpr, GS: tl.constexpr, G: tl.constexpr, NSPLIT: tl.constexpr, SP: tl.constexpr,
                  R: tl.constexpr, RB: tl.constexpr, E: tl.constexpr, EC: tl.constexpr, BASIS: tl.constexpr):
    """One program per (request x KV head ``rh``, query head ``g`` of its group): the splits' states weighed by
    ``exp(m - max)`` (an empty split's max is ``-inf``: weight 0), summed and normalized; with ``BASIS`` the
    result ``[R]`` is mapped through the head's ``[E, RB]`` basis (``EC`` rows at a time), else stored as is."""
    rh = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.arange(0, SP)
    w_at = (rh.to(tl.int64) * NSPLIT + s) * G + g
    m = tl.load(ws_m + w_at, mask=s < NSPLIT, other=float("-inf"))
    top = tl.max(m, 0)
    w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))
    den = tl.sum(w * tl.load(ws_l + w_at, mask=s < NSPLIT, other=0.0), 0)
    r = tl.arange(0, R)
    acc = tl.load(ws_acc + w_at[:, None] * R + r[None, :], mask=(s < NSPLIT)[:, None], other=0.0)
    merged = tl.sum(w[:, None] * acc, 0) / tl.where(den > 0, den, 1.0)
    h = rh % HKV
    orow = out + (rh // HKV).to(tl.int64) * stride_ob + (h * G + g) * stride_oh
    if BASIS:
        base = basis + (h // GS) * stride_bg + ((h % GS) * E) * stride_be
        for c in tl.static_range(E // EC):
            e = c * EC + tl.arange(0, EC)
            b = tl.load(base + e[:, None] * stride_be + r[None, :] * stride_br, mask=(r < RB)[None, :], other=0.0)
            tl.store(orow + e, tl.sum(b.to(tl.float32) * merged[None, :], 1).to(out.dtype.element_ty))
    else:
        tl.store(orow + r, merged.to(out.dtype.element_ty))


def merge_splits(ws_m: torch.Tensor, ws_l: torch.Tensor, ws_acc: torch.Tensor, batch: int, dtype: torch.dtype,
                 basis: torch.Tensor | None = None, basis_heads: int = 1) -> torch.Tensor:
    """The partial states of :func:`split_workspace` (``rows`` = ``batch`` x KV heads, ``splits``, ``G`` query
    heads a KV head, width ``R``) merged into the output ``[batch, KV heads * G, E]`` in ``dtype``, one kernel
    (no host sync, CUDA-graph safe). A split that read nothing (max ``-inf``) weighs 0; a row that read nothing
    gives 0. ``basis`` maps each merged ``[R]`` to ``[E]``, ``out[e] = sum_r merged[r] * basis[..., e, r]``: an
    ``[E, R']`` matrix shared by every head, or ``[groups, basis_heads * E, R']`` per group of ``basis_heads`` KV
    heads (Palu's value basis; ``R' <= R``, the merged width past ``R'`` is padding); without it ``E = R``."""
    rows, splits, g, r = ws_acc.shape
    assert ws_acc.is_contiguous() and ws_m.is_contiguous() and ws_l.is_contiguous() and r & (r - 1) == 0
    hkv = rows // batch
    has_basis = basis is not None
    if basis is None:
        e, rb, strides = r, r, (0, 0, 0)
        basis = ws_acc  # not read
    else:
        if basis.dim() == 2:
            basis = basis[None]
        e, rb = basis.shape[1] // basis_heads, basis.shape[2]
        assert basis.shape[0] * basis_heads == hkv or basis.shape[0] == 1 and basis_heads == 1, "a basis per group"
        assert rb <= r and e & (e - 1) == 0
        strides = (basis.stride(0) if basis.shape[0] > 1 else 0, basis.stride(1), basis.stride(2))
    out = torch.empty(batch, hkv * g, e, dtype=dtype, device=ws_acc.device)
    if out.numel() == 0:
        return out
    _merge_kernel[(rows, g)](ws_m, ws_l, ws_acc, basis, out, *strides, out.stride(0), out.stride(1), HKV=hkv,
                             GS=basis_heads, G=g, NSPLIT=splits, SP=triton.next_power_of_2(splits), R=r, RB=rb, E=e,
                             EC=min(e, 32), BASIS=has_basis, num_warps=4)
    return out


def prefix_passes(prefix_lens: list[int], limit: int) -> list[list[int]]:
    """Requests with a cached prefix, grouped in order so that each group's prefixes fit the workspace (a
    prefix longer than ``limit`` is a group of its own)."""
    groups: list[list[int]] = []
    total = limit + 1
    for i, n in enumerate(prefix_lens):
        if n == 0:
            continue
        if total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def pass_starts(prefix_lens: list[int], members: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """One pass of :func:`prefix_passes`: each request's first workspace row (``-1``: not in this pass), on
    ``device``, and the rows the pass needs."""
    starts = [-1] * len(prefix_lens)
    at = 0
    for i in members:
        starts[i], at = at, at + prefix_lens[i]
    return torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True), at
