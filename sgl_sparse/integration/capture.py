"""Query capture for methods with an observation window (SnapKV): the last ``w`` post-RoPE queries of
each request, per layer, recorded by the attention backend as each layer runs.

Memory: ``w x heads x head_dim`` per layer per request (8 MiB per request at Llama-3-8B shape, w=32),
held only while a request can still be observed: from its first prefill chunk to the final one, or
for its whole life when the method re-selects during decode (``observes_decode``). Only the chunk's
last ``w`` queries are copied, never the whole chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class QueryCapture:
    """Per request (its method's window, or SnapKV's 32 when its own prune scores its ranges, whichever is longer,
    and whether it observes decode; set by :meth:`start` when the runtime first tracks it; other requests of
    methods without a window are never captured)."""

    num_layers: int = 0
    scale: float | None = None
    windows: dict[str, int] = field(default_factory=dict)  # rid -> its method's window (> 0)
    decode: set[str] = field(default_factory=set)  # rids whose method observes decode queries too
    # rid -> layer -> last ``window`` queries ``[n <= window, H, D]``
    queries: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    def start(self, rid: str, window: int, observes_decode: bool) -> None:
        self.windows[rid] = window
        if observes_decode:
            self.decode.add(rid)

    def observes_decode(self, rid: str) -> bool:
        return rid in self.decode

    def record(self, layer_id: int, q: torch.Tensor, rids: list[str], q_lens: list[int], scale: float) -> None:
        """``q``: ``[sum(q_lens), H, D]``, the step's queries of one layer, request after request."""
        if not self.windows:
            return
        self.scale = scale
        self.num_layers = max(self.num_layers, layer_id + 1)
        start = 0
        for rid, n in zip(rids, q_lens):
            q_req = q[start:start + n]
            start += n
            w = self.windows.get(rid)
            if w is None:
                continue
            per_layer = self.queries.setdefault(rid, {})
            prev = per_layer.get(layer_id)
            tail = q_req[-w:]
            if prev is not None and tail.shape[0] < w:
                tail = torch.cat([prev[-(w - tail.shape[0]):], tail])
            per_layer[layer_id] = tail.clone()

    def get(self, rid: str) -> dict[int, torch.Tensor]:
        return self.queries.get(rid, {})

    def prompt_done(self, rid: str) -> None:
        """The request's final prefill was observed: keep capturing only if decode is observed too."""
        if rid not in self.decode:
            self.drop(rid)

    def drop(self, rid: str) -> None:
        self.queries.pop(rid, None)
        self.windows.pop(rid, None)
        self.decode.discard(rid)
