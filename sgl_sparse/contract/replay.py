"""Replay forwards (KVzip's context reconstruction): what :meth:`SparseMethod.replays` asks for and what
:meth:`SparseMethod.on_replay_layer` sees of each layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Replay:
    """An extra forward a method asks for after a prompt is complete (KVzip's context reconstruction): the
    tokens ``token_ids`` at logical positions ``logical_len, logical_len + 1, ...`` of the request, attending
    every retained key of the request and, causally, each other. Their K/V lives in temporary slots for that
    forward only: the request's kept set, its length and its output are as before. ``scored``: the logical
    range ``[lo, hi)`` of the request's keys this replay scores (the method's own bookkeeping)."""

    token_ids: list[int]
    scored: tuple[int, int]


@dataclass(frozen=True)
class ReplayLayer:
    """One layer of a :class:`Replay`'s forward, after its attention: the replay's post-RoPE queries
    ``queries`` (``[r, n_heads, head_dim]``, at logical positions ``logical_len + i``) and keys ``replay_keys``
    (``[r, n_kv_heads, head_dim]``); the request's retained keys are rows ``key_rows`` of ``key_buffer``
    (``[N, n_kv_heads, head_dim]``, the layer's key pool on a server) at sorted logical positions ``k_pos``
    (CPU), as in :class:`~sgl_sparse.contract.ObservationWindow`."""

    layer: int
    queries: torch.Tensor
    replay_keys: torch.Tensor
    key_buffer: torch.Tensor
    key_rows: torch.Tensor
    k_pos: torch.Tensor
    scale: float

    def keys(self, select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The retained keys (``select``: a bool mask or indices over them) ``[n, n_kv_heads, head_dim]`` and
        their logical positions."""
        if select is None:
            return self.key_buffer[self.key_rows], self.k_pos
        rows = self.key_rows[select.to(self.key_rows.device)]
        return self.key_buffer[rows], self.k_pos[select]
