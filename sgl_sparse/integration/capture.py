"""Query capture for methods with an observation window (SnapKV, H2O, R-KV, SkipKV): the last ``w`` post-RoPE
queries of each request, per layer, recorded by the attention backend as each layer runs.

Two homes, by whether the request's method observes decode:

* **prompt only** (SnapKV at its defaults): the last ``w`` queries of the prompt, held on the request's record
  (:class:`~sgl_sparse.request.WindowCapture`) from its first prefill chunk to the final one. Prefill runs eagerly,
  so the backend records them per request id; only each chunk's last ``w`` queries are copied, never the chunk.
* **decode too** (H2O, R-KV, SkipKV, SnapKV with ``decode_interval``): a device ring per layer,
  ``[request rows, W, heads, head_dim]``, indexed by the request's ``req_to_token`` row and the query's position
  modulo ``W`` (:func:`sgl_sparse.rules.decode_window`). A decode step writes every row of its batch there with one
  scatter a layer, from the forward batch's own device tensors (row indices and positions), so SGLang's decode
  CUDA graphs replay the write (a graph has no request ids); padded graph rows write row 0, SGLang's padding
  row. Prefill chunks write their last ``W`` queries into the same ring, so one buffer holds a request's last
  ``W`` queries whatever step made them. The ring's bytes are taken from the KV budget for
  ``--max-running-requests`` + 1 rows (integration/kv_pool.py), as a store's per-request buffers are.

A method reads a window in the step after a forward, which runs before the next forward is launched and whose reads
are queued on the forward's stream (integration/step.py, ``SparseRuntime.before_forward``): the ring then holds the
last ``W`` queries up to the request's length, and a method reads at most ``W`` of them (a method that wants each
decode query once, H2O, observes at least every ``w`` tokens). This module holds what is shared (the ring, layers,
scale) and which records capture now, by rid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_sparse.request import SparseRequest, WindowCapture


@dataclass(frozen=True)
class RingShape:
    """The decode ring's geometry: ``layers`` tensors of ``[rows, width, heads, head_dim]`` in ``dtype``; the pool's
    sizing subtracts :attr:`bytes` from the KV budget and the attention backend allocates exactly this."""

    rows: int
    layers: int
    width: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return self.layers * self.rows * self.width * self.heads * self.head_dim * self.dtype.itemsize


def ring_shape(model_config: Any, rows: int, width: int) -> RingShape:
    """The ring for SGLang's ``model_config`` on this attention-TP rank (its share of the query heads)."""
    from sglang.srt.runtime_context import get_parallel

    heads = model_config.num_attention_heads // get_parallel().attn_tp_size
    return RingShape(rows, model_config.num_hidden_layers, width, heads, model_config.head_dim, model_config.dtype)


@dataclass
class QueryCapture:
    """The records that capture now (its method's window, or SnapKV's 32 when its own prune scores its ranges,
    whichever is longer, and whether it observes decode; set by :meth:`start` when the request's first step
    starts; requests of methods without a window are never captured), and the decode ring (None until
    :meth:`allocate_ring`, and on servers where no method observes decode)."""

    num_layers: int = 0
    scale: float | None = None
    capturing: dict[str, SparseRequest] = field(default_factory=dict)  # rid -> its record (record.capture set)
    ring: list[torch.Tensor] | None = None  # per layer: [request rows, W, heads, head_dim]
    # The decode step's (rows, position mod W), computed at its first layer, and the last layer written.
    _decode_index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _decode_layer: int = field(default=-1, repr=False)
    _decode_src: torch.Tensor | None = field(default=None, repr=False)

    @property
    def ring_width(self) -> int:
        return 0 if self.ring is None else int(self.ring[0].shape[1])

    def allocate_ring(self, shape: RingShape, device: torch.device) -> None:
        """The decode ring, once per server (the attention backend's construction, before graphs are captured)."""
        want = (shape.rows, shape.width, shape.heads, shape.head_dim)
        if self.ring is not None:
            got = tuple(self.ring[0].shape)
            if len(self.ring) != shape.layers or got != want:
                raise RuntimeError(f"sgl_sparse: the decode query ring exists as {len(self.ring)} x {got}, asked "
                                   f"for {shape.layers} x {want}")
            return
        self.ring = [torch.zeros(*want, dtype=shape.dtype, device=device) for _ in range(shape.layers)]
        self.num_layers = shape.layers

    def start(self, rec: SparseRequest, window: int, observes_decode: bool) -> None:
        if observes_decode and window > self.ring_width:
            raise RuntimeError(f"sgl_sparse: request {rec.rid} observes {window} decode queries, more than this "
                               f"server's decode ring keeps ({self.ring_width})")
        rec.capture = WindowCapture(window, observes_decode)
        self.capturing[rec.rid] = rec

    @staticmethod
    def observes_decode(rec: SparseRequest) -> bool:
        return rec.capture is not None and rec.capture.observes_decode

    def write_decode(self, layer_id: int, q: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> None:
        """A decode step's queries ``[batch, H, D]`` into the ring at each row's position (graph-safe: device
        tensors only, no host sync). The indices are computed at a forward's first layer (another positions tensor,
        or a layer id that does not follow the last one) and reused by the others: one scatter a layer."""
        assert self.ring is not None
        if layer_id >= len(self.ring) or q.shape[1:] != self.ring[layer_id].shape[2:]:
            raise RuntimeError(f"sgl_sparse: decode queries of layer {layer_id} are {tuple(q.shape[1:])} a token, "
                               f"the ring was built for {len(self.ring)} layers of {tuple(self.ring[0].shape[2:])}")
        self.scale = scale
        if self._decode_index is None or positions is not self._decode_src or layer_id <= self._decode_layer:
            self._decode_index = (rows.long(), positions.long() % self.ring_width)
        self._decode_src, self._decode_layer = positions, layer_id
        ring = self.ring[layer_id]
        ring[self._decode_index] = q.to(ring.dtype)

    def record(self, layer_id: int, q: torch.Tensor, rids: list[str], q_lens: list[int], scale: float,
               positions: torch.Tensor) -> None:
        """An extend step's queries ``[sum(q_lens), H, D]`` of one layer, request after request; ``positions``: each
        query's position (the forward batch's, on the queries' device), where a request writes the ring."""
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
            if cap.observes_decode:  # start() saw the ring wide enough
                assert self.ring is not None
                t = min(n, self.ring_width)
                ring = self.ring[layer_id]
                ring[rec.pool_idx, positions[start - t:start].long() % ring.shape[1]] = q_req[-t:].to(ring.dtype)
                if cap.ring_from < 0:
                    # the chunk's first position is the request's logical length before this step
                    cap.ring_from = rec.running_state.logical_len + n - t
                continue
            w = cap.window
            prev = cap.queries.get(layer_id)
            tail = q_req[-w:]
            if prev is not None and tail.shape[0] < w:
                tail = torch.cat([prev[-(w - tail.shape[0]):], tail])
            cap.queries[layer_id] = tail.clone()

    def get(self, rec: SparseRequest) -> dict[int, torch.Tensor]:
        """The request's captured queries per layer, oldest first (``[n, H, D]``; from the ring: its last ``n <= W``
        positions up to its logical length)."""
        cap = rec.capture
        if cap is None:
            return {}
        if not cap.observes_decode:
            return cap.queries
        if cap.ring_from < 0:
            return {}
        assert self.ring is not None  # start() saw it wide enough
        end = rec.running_state.logical_len
        width = self.ring_width
        n = min(width, end - cap.ring_from)
        idx = torch.arange(end - n, end, device=self.ring[0].device) % width
        return {layer: ring[rec.pool_idx, idx] for layer, ring in enumerate(self.ring)}

    def prompt_done(self, rec: SparseRequest) -> None:
        """The request's final prefill was observed: keep capturing only if decode is observed too."""
        if not self.observes_decode(rec):
            self.drop(rec)

    def drop(self, rec: SparseRequest) -> None:
        rec.capture = None
        self.capturing.pop(rec.rid, None)
