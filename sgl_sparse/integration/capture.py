"""Query capture for methods with an observation window (SnapKV): the last ``w`` post-RoPE queries of
each request, per layer, recorded by the attention backend as each layer runs.

Memory: ``w x heads x head_dim`` per layer per request (8 MiB per request at Llama-3-8B shape, w=32),
held only while a request can still be observed: from its first prefill chunk to the final one, or
for its whole life when the method re-selects during decode (``observes_decode``). Only the chunk's
last ``w`` queries are copied, never the whole chunk. The queries live on the request's record
(:class:`~sgl_sparse.request.WindowCapture`); this module holds what is shared (layers, scale) and which
records capture now, by rid (the attention backend knows a batch's requests by rid only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sgl_sparse.request import SparseRequest, WindowCapture


@dataclass
class QueryCapture:
    """The records that capture now (its method's window, or SnapKV's 32 when its own prune scores its ranges,
    whichever is longer, and whether it observes decode; set by :meth:`start` when the request's first step
    starts; requests of methods without a window are never captured)."""

    num_layers: int = 0
    scale: float | None = None
    capturing: dict[str, SparseRequest] = field(default_factory=dict)  # rid -> its record (record.capture set)

    def start(self, rec: SparseRequest, window: int, observes_decode: bool) -> None:
        rec.capture = WindowCapture(window, observes_decode)
        self.capturing[rec.rid] = rec

    @staticmethod
    def observes_decode(rec: SparseRequest) -> bool:
        return rec.capture is not None and rec.capture.observes_decode

    def record(self, layer_id: int, q: torch.Tensor, rids: list[str], q_lens: list[int], scale: float) -> None:
        """``q``: ``[sum(q_lens), H, D]``, the step's queries of one layer, request after request."""
        if not self.capturing:
            return
        self.scale = scale
        self.num_layers = max(self.num_layers, layer_id + 1)
        start = 0
        for rid, n in zip(rids, q_lens):
            q_req = q[start:start + n]
            start += n
            rec = self.capturing.get(rid)
            if rec is None or (cap := rec.capture) is None:
                continue
            w = cap.window
            prev = cap.queries.get(layer_id)
            tail = q_req[-w:]
            if prev is not None and tail.shape[0] < w:
                tail = torch.cat([prev[-(w - tail.shape[0]):], tail])
            cap.queries[layer_id] = tail.clone()

    @staticmethod
    def get(rec: SparseRequest) -> dict[int, torch.Tensor]:
        return rec.capture.queries if rec.capture is not None else {}

    def prompt_done(self, rec: SparseRequest) -> None:
        """The request's final prefill was observed: keep capturing only if decode is observed too."""
        if not self.observes_decode(rec):
            self.drop(rec)

    def drop(self, rec: SparseRequest) -> None:
        rec.capture = None
        self.capturing.pop(rec.rid, None)
