"""Attention over an FP8 (E4M3) KV pool with per-(token, head) scales, dequantized in registers: the
decode kernel and the extend kernel over a cached prefix, served by ``fp8_kv`` (``methods/quantization``).

Layout: codes ``[slots, Hkv,
D]`` uint8 (the bits of ``float8_e4m3fn``: :func:`sgl_sparse.kernels.quant.fp8_quantize` viewed as
uint8), scales ``[slots, Hkv]`` fp32, one per token and head, for K and for V. A row's tokens are read
through ``req_to_token`` as in SGLang's own decode kernels.

Grid: request x KV head x ``splits`` (split-KV, so a batch of a few long requests fills the GPU); each
program walks its share of the row's ``seq_lens`` tokens (a graph captured at full width does no work
past a row's real length), keeps the online-softmax state of the group's query heads, and the splits
are merged by ``splits.merge_splits`` (one kernel). The key scale multiplies the logits
(``q . (s_k c) = s_k (q . c)``: one multiply
per token and query head, not one per element); the value scale multiplies the probabilities. On the GPU
both dots take the raw codes on the tensor cores (E4M3 is exact in bf16 and fp16), accumulating in fp32: the
keys' in fp16 against the queries in fp16 (the hardware converts E4M3 pairs straight to fp16: one instruction a
pair, where bf16 takes a second; queries past fp16's 65,504 would overflow, far beyond an LLM's), the values' in
the model dtype against the probabilities times the value scales (which can sit below fp16's normal range).

On the GPU the codes are converted by the hardware (a bitcast to ``float8e4nv``); under
``TRITON_INTERPRET=1``, which has no fp8 types, E4M3 is decoded from its bits by arithmetic (sign, 4-bit
exponent of bias 7, 3-bit mantissa, subnormals at exponent 0). :func:`decode_attention_torch` is the reference.

Extend (:func:`prefix_attention`): the new tokens' queries over their request's cached prefix, read
through ``req_to_token`` as decode reads, no mask (every prefix token precedes every new one); output and
log-sum-exp, to be merged with the new tokens' own causal attention. One program per block of ``BLOCK_M`` query tokens
of one request and one KV head, all ``G`` query heads of the group as rows of one tile, so the prefix
is read once per block, not once per query. On the GPU its dots run in bf16 on the tensor cores (E4M3
codes are exact in bf16; the scales multiply logits and probabilities), accumulating in fp32; under the
interpreter in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_sparse.kernels.splits import (
    decode_splits,
    extend_rows,
    group_queries,
    merge_splits,
    online_step_weighted,
    split_span,
    split_workspace,
    store_rows,
    store_split,
)


def decode_attention_torch(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                           v_scale: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense decode over the dequantized rows, one request at a time (the reference; ``q`` ``[bs, Hq, D]``)."""
    bs, hq, d = q.shape
    hkv = k_codes.shape[1]
    out = torch.zeros_like(q)
    for i in range(bs):
        n = int(seq_lens[i])
        if n == 0:
            continue
        slots = req_to_token[int(req_pool_indices[i]), :n].long()
        k = k_codes[slots].view(torch.float8_e4m3fn).to(torch.float32) * k_scale[slots][..., None]
        v = v_codes[slots].view(torch.float8_e4m3fn).to(torch.float32) * v_scale[slots][..., None]
        qg = q[i].to(torch.float32).view(hkv, hq // hkv, d)
        w = torch.softmax(torch.einsum("hgd,nhd->hgn", qg, k) * scale, dim=-1)
        out[i] = torch.einsum("hgn,nhd->hgd", w, v).reshape(hq, d).to(q.dtype)
    return out


@triton.jit
def _e4m3(b):
    """uint8 bits of E4M3 -> fp32."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))  # 2^-9; (1+m/8)2^(e-7)
    return tl.where((b & 128) != 0, -mag, mag)


@triton.jit
def _decode_codes(b, NATIVE: tl.constexpr):
    """E4M3 bits -> fp32: the hardware conversion on the GPU (one instruction per pair on Hopper), the
    arithmetic one under the interpreter, which has no fp8 types."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return _e4m3(b)


@triton.jit
def _codes16(b, NATIVE: tl.constexpr):
    """E4M3 bits -> fp16 on the GPU (exact; one conversion a pair, none through fp32), fp32 under the interpreter."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        return _e4m3(b)


@triton.jit
def _decode_kernel(q, k_codes, k_scale, v_codes, v_scale, req_to_token, req_pool_indices, seq_lens, ws_m, ws_l,
                   ws_acc, stride_qb, stride_qh, stride_cs, stride_ch, stride_ss, stride_r2t, scale,
                   HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                   NSPLIT: tl.constexpr, NATIVE: tl.constexpr):
    rh, pid, i, h, _, lo, hi = split_span(seq_lens, HKV, BLOCK, NSPLIT)
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    d = tl.arange(0, D)
    qv = group_queries(q, i, h, stride_qb, stride_qh, G, GP, D)
    qk = qv.to(tl.float16) if NATIVE else qv  # E4M3 is exact in fp16: the hardware converts pairs straight to it
    qv = qv.to(q.dtype.element_ty) if NATIVE else qv  # the model dtype (E4M3 is exact in bf16 and fp16)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        ok = pos < hi
        slot = tl.load(row_ptr + pos, mask=ok, other=0).to(tl.int64)
        kc = tl.load(k_codes + slot[:, None] * stride_cs + h * stride_ch + d[None, :], mask=ok[:, None], other=0)
        vc = tl.load(v_codes + slot[:, None] * stride_cs + h * stride_ch + d[None, :], mask=ok[:, None], other=0)
        ks = tl.load(k_scale + slot * stride_ss + h, mask=ok, other=0.0)
        vs = tl.load(v_scale + slot * stride_ss + h, mask=ok, other=0.0)
        # As the extend kernel: raw E4M3 codes (exact in bf16 and fp16) into dots in the model dtype on the
        # GPU, the key scale on the logits and the value scale on the probabilities, fp32 accumulation. Decoding
        # to fp32 and scaling every value element (TF32 dots) reads far below the HBM floor.
        s = tl.dot(qk, tl.trans(_codes16(kc, NATIVE))) * (ks * scale)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m, den, acc = online_step_weighted(m, den, acc, s, _decode_codes(vc, NATIVE).to(qv.dtype), vs)
    store_split(ws_m, ws_l, ws_acc, rh, pid, m, den, acc, NSPLIT, G, GP, D)


def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                     v_scale: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, splits: int | None = None, block: int | None = None,
                     warps: int | None = None, stages: int | None = None) -> torch.Tensor:
    """:func:`decode_attention_torch` as one Triton kernel over the batch, then the splits' merge.
    Codes uint8; no host sync (fixed shapes, loop bounds from ``seq_lens`` on the device). ``splits``:
    :func:`decode_splits` of the batch and the rows' width by default (static shapes, CUDA-graph safe);
    ``block`` (positions an iteration, default 128 on the GPU), ``warps`` (default 2) and ``stages`` (Triton's
    software pipelining of the loop, default Triton's): for timing other choices (``benchmarks/quant_decode.py
    --fp8-blocks``, ``--stages``)."""
    bs, hq, d = q.shape
    hkv = k_codes.shape[1]
    if bs == 0:
        return torch.empty_like(q)
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    assert k_codes.dtype == torch.uint8 and v_codes.stride() == k_codes.stride() and k_codes.stride(2) == 1
    assert v_scale.stride() == k_scale.stride() and k_scale.stride(1) == 1 and q.stride(2) == 1
    g = hq // hkv
    if splits is None:  # scales per token, not per page: only the split count changes here (see kivi_attention)
        splits = decode_splits(bs * hkv, req_to_token.shape[1])
    ws_m, ws_l, ws_acc = split_workspace(bs * hkv, splits, g, d, q.device)
    _decode_kernel[(bs * hkv, splits)](
        q, k_codes, k_scale, v_codes, v_scale, req_to_token, req_pool_indices, seq_lens, ws_m, ws_l, ws_acc,
        q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1), k_scale.stride(0), req_to_token.stride(0),
        # 128 positions an iteration and 2 warps on the GPU: the fastest of the shapes that
        # benchmarks/quant_decode.py --fp8-blocks times (64-256 positions, 1-4 warps).
        scale, HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK=block or (128 if q.is_cuda else 16),
        NSPLIT=splits, NATIVE=q.is_cuda, num_warps=warps or 2, **({"num_stages": stages} if stages else {}))
    return merge_splits(ws_m, ws_l, ws_acc, bs, q.dtype)


def prefix_attention_torch(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                           v_scale: torch.Tensor, qo_indptr: torch.Tensor, req_to_token: torch.Tensor,
                           req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`prefix_attention`, one request at a time."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_codes.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[0], hq), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(qo_indptr.shape[0] - 1):
        q0, q1, n = int(qo_indptr[i]), int(qo_indptr[i + 1]), int(prefix_lens[i])
        if q1 == q0 or n == 0:
            continue
        slots = req_to_token[int(req_pool_indices[i]), :n].long()
        k = k_codes[slots].view(torch.float8_e4m3fn).to(torch.float32) * k_scale[slots][..., None]
        v = v_codes[slots].view(torch.float8_e4m3fn).to(torch.float32) * v_scale[slots][..., None]
        qg = q[q0:q1].to(torch.float32).view(q1 - q0, hkv, hq // hkv, d)
        logits = torch.einsum("thgd,nhd->thgn", qg, k) * scale
        lse[q0:q1] = torch.logsumexp(logits, dim=-1).reshape(q1 - q0, hq)
        o = torch.einsum("thgn,nhd->thgd", torch.softmax(logits, dim=-1), v)
        out[q0:q1] = o.reshape(q1 - q0, hq, d).to(q.dtype)
    return out, lse


@triton.jit
def _prefix_kernel(q, k_codes, k_scale, v_codes, v_scale, qo_indptr, req_to_token, req_pool_indices, prefix_lens,
                   blk_req, blk_start, out, lse, stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch,
                   stride_ss, stride_r2t, scale,
                   HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, NATIVE: tl.constexpr):
    i, tok, head, rm, qv = extend_rows(q, qo_indptr, blk_req, blk_start, stride_qt, stride_qh, G, GP, D, BLOCK_M)
    qv = qv.to(tl.bfloat16) if NATIVE else qv.to(tl.float32)
    h = tl.program_id(1)
    kv_hi = tl.load(prefix_lens + i)
    row_ptr = req_to_token + tl.load(req_pool_indices + i).to(tl.int64) * stride_r2t
    d = tl.arange(0, D)
    m = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, D], tl.float32)
    for start in range(0, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < kv_hi
        slot = tl.load(row_ptr + pos, mask=ok, other=0).to(tl.int64)
        kc = tl.load(k_codes + slot[:, None] * stride_cs + h * stride_ch + d[None, :], mask=ok[:, None], other=0)
        vc = tl.load(v_codes + slot[:, None] * stride_cs + h * stride_ch + d[None, :], mask=ok[:, None], other=0)
        ks = tl.load(k_scale + slot * stride_ss + h, mask=ok, other=0.0)
        vs = tl.load(v_scale + slot * stride_ss + h, mask=ok, other=0.0)
        # E4M3 values are exact in bf16: on the GPU the dots take the raw codes on the tensor cores, the scales
        # applied to the logits (keys) and to the probabilities (values), accumulation in fp32.
        s = tl.dot(qv, tl.trans(_decode_codes(kc, NATIVE).to(qv.dtype))) * (ks * scale)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m, den, acc = online_step_weighted(m, den, acc, s, _decode_codes(vc, NATIVE).to(qv.dtype), vs)
    store_rows(out, lse, tok, head, rm, m, den, acc, stride_ot, stride_oh, HQ, D)


def prefix_block_m(group: int, cuda: bool, block_m: int | None = None) -> int:
    """Query tokens per program: 128-row tiles (tokens x the group's heads) for the tensor cores on the GPU,
    at least 16 rows (``tl.dot``'s minimum)."""
    gp = triton.next_power_of_2(group)
    if block_m is None:
        block_m = max(1, 128 // gp) if cuda else 16
    return max(block_m, 16 // gp)


def prefix_blocks(extend_lens: list[int], block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (request, first query token) of every block of ``block_m`` new tokens: the extend grid, from
    the host's extend lengths (extend steps run eagerly)."""
    req: list[int] = []
    start: list[int] = []
    for i, n in enumerate(extend_lens):
        for t in range(0, n, block_m):
            req.append(i)
            start.append(t)
    as_tensor = torch.tensor([req, start], dtype=torch.int32)
    as_tensor = as_tensor.pin_memory() if device.type == "cuda" else as_tensor
    both = as_tensor.to(device, non_blocking=True)
    return both[0], both[1]


class StepBlocks:
    """:func:`prefix_blocks` of the current extend step, built once: every layer of a step passes the same
    ``extend_lens`` list (the runtime's, per forward), so it is the key."""

    def __init__(self) -> None:
        self._key: list[int] | None = None
        self._blocks: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, extend_lens: list[int], block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._blocks is None or self._key is not extend_lens:
            self._key, self._blocks = extend_lens, prefix_blocks(extend_lens, block_m, device)
        return self._blocks


def prefix_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                     v_scale: torch.Tensor, qo_indptr: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, scale: float, extend_lens: list[int],
                     block_m: int | None = None, block_n: int = 64,
                     blocks: tuple[torch.Tensor, torch.Tensor] | None = None, warps: int | None = None,
                     stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prefix_attention_torch` as one Triton kernel: ``q`` ``[n, Hq, D]`` (row ``qo_indptr[i]`` on
    for request ``i``, ``extend_lens[i]`` of them) over the first ``prefix_lens[i]`` slots of its row
    ``req_to_token[req_pool_indices[i]]`` -> (output ``[n, Hq, D]``, fp32 natural log-sum-exp ``[n, Hq]``,
    ``-inf`` over an empty prefix). ``blocks``: :func:`prefix_blocks` of this step, if the caller keeps them
    (every layer of a step has the same). ``warps`` / ``stages``: Triton's launch options (tile sweeps,
    benchmarks/quant_prefill.py; default 8 warps on the GPU and Triton's own stages)."""
    n, hq, d = q.shape
    hkv = k_codes.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((n, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 0:
        return out, lse
    assert d & (d - 1) == 0, "head_dim must be a power of two"
    assert k_codes.dtype == torch.uint8 and v_codes.stride() == k_codes.stride() and k_codes.stride(2) == 1
    assert v_scale.stride() == k_scale.stride() and k_scale.stride(1) == 1 and q.stride(2) == 1
    g = hq // hkv
    gp = triton.next_power_of_2(g)
    bm = prefix_block_m(hq // hkv, q.is_cuda, block_m)
    blk_req, blk_start = blocks if blocks is not None else prefix_blocks(extend_lens, bm, q.device)
    _prefix_kernel[(blk_req.shape[0], hkv)](
        q, k_codes, k_scale, v_codes, v_scale, qo_indptr, req_to_token, req_pool_indices, prefix_lens, blk_req,
        blk_start, out, lse, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_codes.stride(0),
        k_codes.stride(1), k_scale.stride(0), req_to_token.stride(0), scale, HQ=hq, G=g, GP=gp, D=d, BLOCK_M=bm,
        BLOCK_N=block_n, NATIVE=q.is_cuda, num_warps=warps or (8 if q.is_cuda else 4),
        **({"num_stages": stages} if stages else {}))
    return out, lse
