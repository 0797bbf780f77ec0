"""One layer of the toy attention stack (``sgl_sparse.reference.ToyAttentionStack``) in plain loops, shared by
the eviction methods' plain-torch references (SnapKV, R-KV, SkipKV): the step's K/V stored, its queries
appended to the observation window, each new query attending its retained positions up to itself."""

from __future__ import annotations

import torch

from sgl_sparse.reference import ToyAttentionStack


def attend_retained(model: ToyAttentionStack, layer: int, h: torch.Tensor, start: int, end: int, retained: list[int],
                    keys: list[torch.Tensor], vals: list[torch.Tensor], query_cache: list[torch.Tensor], window: int,
                    double: bool = False) -> torch.Tensor:
    """Positions ``start..end`` through ``layer``: writes their K/V into ``keys[layer]`` / ``vals[layer]``, keeps
    the last ``window`` queries in ``query_cache[layer]``, returns the attention output ``[end - start, Hq * D]``
    (in float64 when ``double``)."""
    q, k, v = model.project(layer, h)
    keys[layer][start:end], vals[layer][start:end] = k, v
    query_cache[layer] = torch.cat([query_cache[layer], q])[-window:]
    group = model.n_heads // model.n_kv_heads
    out = torch.zeros_like(q)
    for i in range(end - start):
        visible = [j for j in retained if j <= start + i]
        for head in range(model.n_heads):
            kk, vv, qq = keys[layer][visible, head // group], vals[layer][visible, head // group], q[i, head]
            if double:
                kk, vv, qq = kk.double(), vv.double(), qq.double()
            probs = (kk @ qq / model.head_dim**0.5).softmax(0)
            out[i, head] = (probs @ vv).float()
    return out.reshape(end - start, -1)
