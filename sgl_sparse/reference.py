"""A plain-torch driver of the lifecycle contract, for testing methods without a server.

:class:`ToyAttentionStack` is a few layers of causal GQA attention over fixed random projections
(no RoPE, no MLP: methods only see post-RoPE q/k, so the stack need not be a real model).
:func:`run_request` drives one request through chunked prefill and decode exactly in the hook order
documented in :mod:`sgl_sparse.contract`, applying ``Selection`` and ``KeepPlan`` by masking which
logical positions each layer reads. It is slow and simple on purpose: it is the reference the real
runtime (tree, pool, attention backend) is compared against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.contract import LayerInput, PrefillChunk, SparseMethod, StepInfo


class ToyAttentionStack:
    def __init__(self, n_layers: int = 3, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 16,
                 vocab: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        d = n_heads * head_dim
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, n_heads, n_kv_heads, head_dim
        self.embed = torch.randn(vocab, d, generator=g)
        self.wq = [torch.randn(d, n_heads * head_dim, generator=g) * d**-0.5 * 2 for _ in range(n_layers)]
        self.wk = [torch.randn(d, n_kv_heads * head_dim, generator=g) * d**-0.5 * 2 for _ in range(n_layers)]
        self.wv = [torch.randn(d, n_kv_heads * head_dim, generator=g) * d**-0.5 for _ in range(n_layers)]

    def project(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        return (
            (h @ self.wq[layer]).view(n, self.n_heads, self.head_dim),
            (h @ self.wk[layer]).view(n, self.n_kv_heads, self.head_dim),
            (h @ self.wv[layer]).view(n, self.n_kv_heads, self.head_dim),
        )


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           kv_pos: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention by logical position: query i sees keys with ``kv_pos <= q_pos[i]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill((kv_pos[None, :] > q_pos[:, None])[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@dataclass
class RequestTrace:
    """Outputs of :func:`run_request`: last-layer attention output of every processed token."""

    outputs: torch.Tensor
    kept_after_step: list[int] = field(default_factory=list)
    state: Any = None


def run_request(method: SparseMethod[Any], model: ToyAttentionStack, tokens: list[int], prompt_len: int,
                chunk_size: int, window: int = 8) -> RequestTrace:
    """Prefill ``tokens[:prompt_len]`` in chunks, then decode the rest one token at a time (teacher
    forcing: the sequence is given, so dense and sparse runs are compared position by position)."""
    h_all = model.embed[torch.tensor(tokens)]
    n_total = len(tokens)
    keys = [torch.zeros(n_total, model.n_kv_heads, model.head_dim) for _ in range(model.n_layers)]
    vals = [torch.zeros_like(keys[0]) for _ in range(model.n_layers)]
    state = method.new_state("ref")
    outs: list[torch.Tensor] = []
    trace = RequestTrace(outputs=torch.empty(0))

    steps: list[tuple[int, int]] = [(s, min(s + chunk_size, prompt_len)) for s in range(0, prompt_len, chunk_size)]
    steps += [(i, i + 1) for i in range(prompt_len, n_total)]
    decoded = 0
    for start, end in steps:
        is_prefill = end <= prompt_len
        chunk = PrefillChunk(start, end, prompt_len)
        if is_prefill:
            method.on_prefill_chunk(state, chunk)
        q_pos = torch.arange(start, end)
        retained = torch.arange(start) if state.kept is None else state.kept
        kv_pos = torch.cat([retained, q_pos])
        h = h_all[start:end]
        window_q: dict[int, torch.Tensor] = {}
        for layer in range(model.n_layers):
            q, k, v = model.project(layer, h)
            keys[layer][start:end], vals[layer][start:end] = k, v
            view = LayerInput(layer, q, q_pos, keys[layer][kv_pos], vals[layer][kv_pos], kv_pos, not is_prefill)
            sel = method.before_attention(state, view) if method.needs_layer_hooks else None
            pos = kv_pos if sel is None or sel.positions is None else sel.positions
            out = attend(q, keys[layer][pos], vals[layer][pos], q_pos, pos)
            if method.needs_layer_hooks:
                method.after_attention(state, view, out)
                window_q[layer] = q[-window:]
            h = out.reshape(end - start, -1)
        outs.append(h)
        state.logical_len = end
        if is_prefill and chunk.is_final and method.needs_layer_hooks:
            method.on_prefill_end(state, window_q)
        decoded += 0 if is_prefill else 1
        plan = method.on_step_end(state, StepInfo(is_prefill, end - start, decoded))
        if plan is not None:
            if not method.evicts:
                raise RuntimeError(f"{method.name} returned a KeepPlan but does not declare evicts=True")
            current = torch.arange(end) if state.kept is None else torch.cat([state.kept, q_pos]).unique()
            if not bool(torch.isin(plan.keep, current).all()):
                raise RuntimeError(f"{method.name}: KeepPlan keeps positions that are not retained")
            state.kept = plan.keep.sort().values
        elif state.kept is not None:
            state.kept = torch.cat([state.kept, q_pos])
        trace.kept_after_step.append(state.num_kept())
    method.on_finish(state)
    trace.outputs = torch.cat(outs)
    trace.state = state
    return trace
