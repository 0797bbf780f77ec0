"""The decode query ring (sgl_sparse/integration/capture.py) without a server: prefill chunks and decode steps of
several requests written as the attention backend writes them (decode: one scatter by row and position, as inside
a CUDA graph, padding rows included), read back as a window, against a plain-torch reference that keeps each
request's whole query history."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_sparse.contract import RequestState
from sgl_sparse.integration.capture import QueryCapture, RingShape
from sgl_sparse.request import SparseRequest

LAYERS, HEADS, DIM = 2, 3, 4
CPU = torch.device("cpu")


def _record(rid: str, row: int, capture: QueryCapture, window: int, prefix: int = 0) -> SparseRequest:
    rec = SparseRequest(rid, served=SimpleNamespace(method=None))  # type: ignore[arg-type]
    st = RequestState(rid=rid)
    st.set_kept(torch.arange(prefix), logical_len=prefix)
    rec.start(st, row)
    capture.start(rec, window, observes_decode=True)
    return rec


def _queries(gen: torch.Generator, n: int) -> list[torch.Tensor]:
    return [torch.randn(n, HEADS, DIM, generator=gen) for _ in range(LAYERS)]


@pytest.mark.parametrize("width", [8, 5])
def test_the_ring_holds_each_requests_last_queries_across_chunks_and_decode(width: int) -> None:
    gen = torch.Generator().manual_seed(0)
    cap = QueryCapture()
    cap.allocate_ring(RingShape(6, LAYERS, width, HEADS, DIM, torch.float32), CPU)
    # Request a: a 13-token prompt in chunks of 10 and 3; b: a 3-token prompt after a 20-token prefix hit (its
    # queries start at position 20); c: a 2-token prompt (fewer queries than the ring holds).
    recs = {"a": _record("a", 2, cap, width), "b": _record("b", 5, cap, width, prefix=20),
            "c": _record("c", 1, cap, width)}
    history: dict[str, list[list[torch.Tensor]]] = {rid: [[] for _ in range(LAYERS)] for rid in recs}

    def extend(chunks: dict[str, int]) -> None:
        rids, lens = list(chunks), list(chunks.values())
        qs = _queries(gen, sum(lens))
        positions = torch.cat([torch.arange(recs[r].running_state.logical_len, recs[r].running_state.logical_len + n)
                               for r, n in chunks.items()])
        for layer in range(LAYERS):
            cap.record(layer, qs[layer], rids, lens, 0.5, positions)
        at = 0
        for r, n in chunks.items():
            for layer in range(LAYERS):
                history[r][layer].append(qs[layer][at:at + n])
            at += n
            recs[r].running_state.advance(n)

    def decode(rids: list[str], padding: int) -> None:
        qs = _queries(gen, len(rids) + padding)
        rows = torch.tensor([recs[r].pool_idx for r in rids] + [0] * padding)  # graph padding: SGLang's row 0
        positions = torch.tensor([recs[r].running_state.logical_len for r in rids] + [0] * padding)
        for layer in range(LAYERS):
            cap.write_decode(layer, qs[layer], rows, positions, 0.5)
        for i, r in enumerate(rids):
            for layer in range(LAYERS):
                history[r][layer].append(qs[layer][i:i + 1])
            recs[r].running_state.advance(1)

    def check() -> None:
        for r, rec in recs.items():
            got = cap.get(rec)
            assert set(got) == set(range(LAYERS))
            for layer in range(LAYERS):
                want = torch.cat(history[r][layer])[-width:]
                torch.testing.assert_close(got[layer], want, rtol=0, atol=0)

    extend({"a": 10, "b": 3, "c": 2})
    check()
    extend({"a": 3})
    check()
    for step in range(2 * width + 3):
        decode(["a", "b", "c"] if step % 4 else ["c", "a", "b"], padding=2)
        if step % 3 == 0:
            check()
    extend({"b": 1})  # a mixed chunk's decode token goes through the extend path
    check()
    assert cap.scale == 0.5 and cap.num_layers == LAYERS


def test_a_window_wider_than_the_ring_is_refused_and_prompt_only_capture_keeps_its_dict() -> None:
    cap = QueryCapture()
    cap.allocate_ring(RingShape(3, 1, 4, HEADS, DIM, torch.float32), CPU)
    with pytest.raises(RuntimeError, match="more than this server's decode ring keeps"):
        _record("wide", 1, cap, window=5)
    rec = SparseRequest("p", served=SimpleNamespace(method=None))  # type: ignore[arg-type]
    rec.start(RequestState(rid="p"), 2)
    cap.start(rec, 6, observes_decode=False)  # prompt only: the record's own copy, any window
    q = torch.randn(9, HEADS, DIM)
    cap.record(0, q, ["p"], [9], 1.0, torch.arange(9))
    torch.testing.assert_close(cap.get(rec)[0], q[-6:])
    assert float(cap.ring[0][2].abs().sum()) == 0.0  # nothing went to the ring  # type: ignore[index]


def test_the_ring_is_allocated_once_per_shape() -> None:
    cap = QueryCapture()
    shape = RingShape(3, 2, 4, HEADS, DIM, torch.float32)
    cap.allocate_ring(shape, CPU)
    ring = cap.ring
    cap.allocate_ring(shape, CPU)
    assert cap.ring is ring
    assert shape.bytes == sum(t.numel() * t.element_size() for t in ring or [])  # what the pool's sizing takes
    with pytest.raises(RuntimeError, match="exists as"):
        cap.allocate_ring(RingShape(3, 2, 8, HEADS, DIM, torch.float32), CPU)


def test_a_query_shape_the_ring_was_not_built_for_is_a_clear_error() -> None:
    cap = QueryCapture()
    cap.allocate_ring(RingShape(3, 2, 4, HEADS, DIM, torch.float32), CPU)
    rows, positions = torch.tensor([1]), torch.tensor([5])
    with pytest.raises(RuntimeError, match="the ring was built for 2 layers"):
        cap.write_decode(2, torch.randn(1, HEADS, DIM), rows, positions, 1.0)
    with pytest.raises(RuntimeError, match="decode queries of layer 0 are"):
        cap.write_decode(0, torch.randn(1, HEADS, DIM + 1), rows, positions, 1.0)
