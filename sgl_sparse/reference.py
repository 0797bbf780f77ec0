"""A plain-torch driver of the lifecycle contract, for testing methods without a server.

:class:`ToyAttentionStack` is a few layers of causal GQA attention over fixed random projections
(no RoPE, no MLP: methods only see post-RoPE q/k, so the stack need not be a real model).
:func:`run_request` drives one request through chunked prefill and decode exactly in the hook order
documented in :mod:`sgl_sparse.contract` (the same hooks the server drives, a selector's included),
applying a ``KeepPlan`` and a selector's pages by masking which logical positions each layer (and
KV head) reads. It is slow and simple on purpose: it is the reference the real runtime (tree, pool,
attention backend) is compared against. A selector sees the request as a one-row batch whose
position ``p`` lives in slot ``p + page_size`` (page-aligned; slot page 0 is padding, as on a server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.contract import (
    KVGeometry,
    ObservationWindow,
    PrefillChunk,
    Replay,
    ReplayLayer,
    SelectorStep,
    SparseMethod,
    StepInfo,
)
from sgl_sparse.kernels.pages import selected_positions_mask
from sgl_sparse.prune.keep import ReplayInputs, request_prune_leaves
from sgl_sparse.prune.spec import KVZIP_GLOBAL, SNAPKV_WINDOW, PruneSpec
from sgl_sparse.rules import check_keep_plan


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


def _attend_per_kv_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        kv_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`attend` where KV head ``h`` (and its query group) reads only the positions ``mask[h]``."""
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    outs = []
    for h in range(hkv):
        pos = kv_pos[mask[h, kv_pos]]
        heads = slice(h * group, (h + 1) * group)
        outs.append(attend(q[:, heads], k[pos][:, h:h + 1], v[pos][:, h:h + 1], q_pos, pos))
    return torch.cat(outs, dim=1)


@dataclass
class RequestTrace:
    """Outputs of :func:`run_request`: last-layer attention output of every processed token."""

    outputs: torch.Tensor
    kept_after_step: list[int] = field(default_factory=list)
    state: Any = None


def run_request(method: SparseMethod[Any], model: ToyAttentionStack, tokens: list[int], prompt_len: int,
                chunk_size: int, prune: list[tuple[int, int]] | PruneSpec | None = None,
                prune_replays: Any = None) -> RequestTrace:
    """Prefill ``tokens[:prompt_len]`` in chunks, then decode the rest one token at a time (teacher
    forcing: the sequence is given, so dense and sparse runs are compared position by position).
    ``prune``: the request's prune of its own prompt (as ``custom_params['sgl_sparse_prune']``): logical ``[l, r)``
    ranges, or a :class:`~sgl_sparse.prune.spec.PruneSpec` with a scored keep; what leaves does so at the end of
    the final chunk through ``on_prune``, as on the server (:func:`~sgl_sparse.prune.keep.request_prune_leaves`).
    ``prune_replays``: the ``kvzip`` config a ``kvzip_global`` keep replays with (default: KVzip's defaults, no
    instruction tokens)."""
    if prune is not None and not isinstance(prune, PruneSpec):
        prune = PruneSpec(tuple(prune))
    h_all = model.embed[torch.tensor(tokens)]
    n_total = len(tokens)
    keys = [torch.zeros(n_total, model.n_kv_heads, model.head_dim) for _ in range(model.n_layers)]
    vals = [torch.zeros_like(keys[0]) for _ in range(model.n_layers)]
    retained = torch.zeros(n_total, dtype=torch.bool)  # the "row": which positions still have K/V
    state = method.new_state("ref")
    w = method.observation_window()
    # Captured: the longer of the method's window and a scored prune's (as the server's capture).
    w_cap = max(w, SNAPKV_WINDOW) if prune is not None and prune.needs_window else w
    window_q: dict[int, torch.Tensor] = {}
    outs: list[torch.Tensor] = []
    trace = RequestTrace(outputs=torch.empty(0))

    sel = method.selector
    ps = sel.page_size if sel is not None else 1
    k_pool = [torch.zeros(n_total + 2 * ps, model.n_kv_heads, model.head_dim) for _ in range(model.n_layers)]
    v_pool = [torch.zeros_like(k) for k in k_pool]
    r2t = torch.zeros(2, n_total, dtype=torch.int32)
    r2t[1] = torch.arange(n_total, dtype=torch.int32) + ps
    rpi = torch.tensor([1])
    if sel is not None:
        sel.allocate(KVGeometry(model.n_layers, model.n_heads, model.n_kv_heads, model.head_dim, ps,
                                n_total + 2 * ps, torch.float32, torch.device("cpu"), max_requests=r2t.shape[0]))

    steps = [(s, min(s + chunk_size, prompt_len)) for s in range(0, prompt_len, chunk_size)]
    steps += [(i, i + 1) for i in range(prompt_len, n_total)]
    decoded = 0
    for start, end in steps:
        is_prefill = end <= prompt_len
        chunk = PrefillChunk(start, end, prompt_len)
        if is_prefill:
            method.on_prefill_chunk(state, chunk)
        q_pos = torch.arange(start, end)
        kv_pos = torch.cat([retained[:start].nonzero().flatten(), q_pos])
        h = h_all[start:end]
        if sel is not None:
            sel.bind([state], rpi.tolist())
        for layer in range(model.n_layers):
            q, k, v = model.project(layer, h)
            keys[layer][start:end], vals[layer][start:end] = k, v
            k_pool[layer][start + ps:end + ps] = k
            v_pool[layer][start + ps:end + ps] = v
            selecting = sel is not None and sel.selects(layer)
            if selecting:
                sel.on_kv_write(layer, torch.arange(start, end) + ps, k)
            seq = torch.tensor([end])
            if selecting and not is_prefill and sel.attends:
                out = sel.attend(layer, q, k_pool[layer], v_pool[layer], r2t, rpi, seq, model.head_dim**-0.5)
            elif selecting and (not is_prefill or sel.static):  # a static selection also holds in prefill
                pages = sel.select(layer, q, r2t, rpi, seq)
                mask = selected_positions_mask(pages, seq, model.n_kv_heads, ps, end)[0]  # [Hkv, end]
                out = _attend_per_kv_head(q, keys[layer], vals[layer], q_pos, kv_pos, mask)
            else:
                out = attend(q, keys[layer][kv_pos], vals[layer][kv_pos], q_pos, kv_pos)
            if sel is not None and not is_prefill and sel.observes(layer):
                sel.observe(layer, q, k_pool[layer], r2t, rpi, seq)
            if w_cap:
                window_q[layer] = torch.cat([window_q.get(layer, q[:0]), q])[-w_cap:]
            h = out.reshape(end - start, -1)
        outs.append(h)
        if sel is not None and sel.maintains:
            sel.after_step(SelectorStep(rpi, torch.tensor([start]), torch.tensor([end]), r2t,
                                        lambda layer: (k_pool[layer], v_pool[layer])))
        retained[start:end] = True
        state.advance(end - start)
        decoded += 0 if is_prefill else 1
        step = StepInfo(is_prefill, end - start, decoded, final_prefill=is_prefill and chunk.is_final,
                        token_ids=(lambda a, b, e=end: tokens[a:min(b, e)]) if method.needs_token_ids() else None)
        if step.final_prefill and prune:
            kept = state.kept
            replays = None
            if prune.policy == KVZIP_GLOBAL:
                from sgl_sparse.methods.eviction.kvzip import KVzipConfig

                def run_replays(rs: list[Replay], scorer: Any, k: torch.Tensor = kept) -> None:
                    for r in rs:
                        _run_replay(scorer, model, state, r, keys, vals, k)

                replays = ReplayInputs(tokens[:end], prune_replays or KVzipConfig(), 1 << 30, run_replays)
            gone = request_prune_leaves(kept, prune, lambda e=end, k=kept: _window(window_q, SNAPKV_WINDOW, e, keys, k,
                                                                                   model), replays)
            if bool(gone.any()):
                method.on_prune(state, kept[gone])
                retained[kept[gone]] = False
                state.set_kept(kept[~gone])
        if step.final_prefill:
            positions = retained.nonzero().flatten()
            for replay in method.replays(state, step, max_tokens=1 << 30):
                _run_replay(method, model, state, replay, keys, vals, positions)
        if w and method.wants_observation(state, step):
            method.on_observation(state, _window(window_q, w, end, keys, retained.nonzero().flatten(), model))
        plan = method.on_step_end(state, step)
        if plan is not None:
            keep = check_keep_plan(method, plan, state.kept)
            retained[:] = False
            retained[keep] = True
            state.set_kept(keep)
        trace.kept_after_step.append(state.num_kept)
    method.on_finish(state)
    trace.outputs = torch.cat(outs)
    trace.state = state
    return trace


def _window(window_q: dict[int, torch.Tensor], w: int, end: int, keys: list[torch.Tensor], positions: torch.Tensor,
            model: ToyAttentionStack) -> ObservationWindow:
    """The last ``w`` captured queries (ending at position ``end``) over the retained keys at ``positions``."""
    queries = {layer: q[-w:] for layer, q in window_q.items()}
    n_w = queries[0].shape[0]
    return ObservationWindow(queries=queries, q_pos=torch.arange(end - n_w, end), key_buffer=lambda layer: keys[layer],
                             key_rows=positions, k_pos=positions, num_layers=model.n_layers,
                             scale=model.head_dim**-0.5)


def _run_replay(scorer: Any, model: ToyAttentionStack, state: Any, replay: Replay,
                keys: list[torch.Tensor], vals: list[torch.Tensor], positions: torch.Tensor) -> None:
    """A :class:`Replay` forward: its tokens after the retained K/V (``positions``), attending those and,
    causally, each other; each layer handed to ``scorer.on_replay_layer`` (the method's, or a prune's
    ``kvzip_global`` scorer); its K/V dropped afterwards."""
    r = len(replay.token_ids)
    h = model.embed[torch.tensor(replay.token_ids)]
    q_pos = torch.arange(state.logical_len, state.logical_len + r)
    kv_pos = torch.cat([positions, q_pos])
    for layer in range(model.n_layers):
        q, k, v = model.project(layer, h)
        out = attend(q, torch.cat([keys[layer][positions], k]), torch.cat([vals[layer][positions], v]), q_pos,
                     kv_pos)
        scorer.on_replay_layer(state, replay, ReplayLayer(layer, q, k, keys[layer], positions, positions,
                                                          model.head_dim**-0.5))
        h = out.reshape(r, -1)
