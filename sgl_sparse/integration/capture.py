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
    window: int  # 0: the method observes nothing, capture is off
    observes_decode: bool
    num_layers: int = 0
    scale: float | None = None
    # rid -> layer -> last ``window`` queries ``[n <= window, H, D]``
    queries: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    # rids whose prompt is complete and that will not be observed again (decode queries skipped)
    done: set[str] = field(default_factory=set)

    def record(self, layer_id: int, q: torch.Tensor, rids: list[str], q_lens: list[int], scale: float) -> None:
        """``q``: ``[sum(q_lens), H, D]``, the step's queries of one layer, request after request."""
        if self.window <= 0:
            return
        self.scale = scale
        self.num_layers = max(self.num_layers, layer_id + 1)
        w, start = self.window, 0
        for rid, n in zip(rids, q_lens):
            q_req = q[start:start + n]
            start += n
            if rid in self.done:
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
        if not self.observes_decode:
            self.queries.pop(rid, None)
            self.done.add(rid)

    def drop(self, rid: str) -> None:
        self.queries.pop(rid, None)
        self.done.discard(rid)
