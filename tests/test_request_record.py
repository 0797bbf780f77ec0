"""The per-request record (sgl_sparse/request.py) as the runtime drives it, without a server: made at admission,
started at the first forward step, stopped at finish; the one handle on SGLang's request; captured queries on the
record; a replay's context handed to the attention backend for its forward only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_sparse.integration.replay import replaying
from sgl_sparse.integration.runtime import SparseRuntime
from sgl_sparse.radix.records import VIEW_ATTR
from sgl_sparse.registry import create_method
from sgl_sparse.request import HANDLE, SparseRequest, match_view, record_of, set_match_view
from sgl_sparse.request_methods import EVICTION, MethodResolver


def _runtime(method: str = "snapkv", policy: str = EVICTION) -> SparseRuntime:
    m = create_method(method)
    return SparseRuntime(method=m, fingerprint=m.config.fingerprint(), resolver=MethodResolver(m, policy))


def _req(rid: str = "r0", prompt: int = 40, custom_params: dict | None = None) -> SimpleNamespace:
    aborts: list[str] = []
    return SimpleNamespace(
        rid=rid, origin_input_ids=list(range(prompt)), output_ids=[], extra_key=None, multimodal_inputs=None,
        sampling_params=SimpleNamespace(custom_params=custom_params), prefix_indices=torch.empty(0, dtype=torch.int64),
        req_pool_idx=3, aborts=aborts, set_finish_with_abort=aborts.append)


def test_admission_makes_the_record_and_sets_one_handle() -> None:
    rt = _runtime()
    req = _req(custom_params={"sgl_sparse_method": "h2o", "sgl_sparse_prune": {"ranges": [[4, 12]]}})
    before = set(vars(req))
    rec = rt.admit(req)
    assert set(vars(req)) - before == {HANDLE}
    assert record_of(req) is rec and rt.admit(req) is rec  # idempotent: a retracted request comes back
    assert rec.method.name == "h2o" and rec.served.source == "request"
    assert rec.prune is not None and rec.prune.ranges == ((4, 12),)
    assert req.extra_key == f"sgl_sparse={rec.served.fingerprint}"  # its own prefix-tree namespace
    assert not rec.started and rt.tracked == {}  # nothing runs until its first forward step
    assert rt.evicts_for(req) and not req.aborts


def test_first_step_starts_the_record_and_finish_stops_it() -> None:
    rt = _runtime()
    req = _req()
    rt.admit(req)
    rec = rt.track(req)
    assert rec.started and rec.pool_idx == 3 and rt.tracked == {"r0": rec}
    assert rt.track(req) is rec
    assert rec.capture is not None and rec.capture.window == rt.method.observation_window()
    q = torch.randn(40, 2, 4)
    for layer in range(2):
        rt.capture.record(layer, q, ["r0"], [40], 0.5, torch.arange(40))
    assert set(rec.capture.queries) == {0, 1} and rec.capture.queries[0].shape[0] == rec.capture.window
    rec.state.advance(40)
    done = rt.finish(req)
    assert done is not None and done.logical_len == 40
    assert not rec.started and rec.capture is None and rt.tracked == {} and not rt.capture.capturing
    assert record_of(req) is rec and rt.finish(req) is None  # the record stays; its run is gone


def test_match_view_goes_on_the_record_or_on_a_probe() -> None:
    rt = _runtime()
    req = _req()
    rt.admit(req)
    view = SimpleNamespace(length=0, kept=torch.empty(0), record=None, payload=None)
    set_match_view(req, view)
    assert record_of(req).view is view and match_view(req) is view and not hasattr(req, VIEW_ATTR)
    probe = SimpleNamespace()  # radix/prune.py's stand-in: no record
    set_match_view(probe, view)
    assert getattr(probe, VIEW_ATTR) is view and match_view(probe) is view


def test_a_replay_context_is_the_backends_for_its_forward_only() -> None:
    backend = SimpleNamespace(replay=None)
    active = object()
    with pytest.raises(ValueError), replaying(backend, active):  # type: ignore[arg-type]
        assert backend.replay is active
        raise ValueError("the forward failed")
    assert backend.replay is None
    with pytest.raises(RuntimeError, match="attention backend"), replaying(SimpleNamespace(), active):  # type: ignore[arg-type]
        pass


def test_record_stop_resets_the_run() -> None:
    rec = SparseRequest("r", served=SimpleNamespace(method=None), prompt_done=True, pruned=True,
                        evict_branches_after=5)
    rec.stop()
    assert (rec.prompt_done, rec.pruned, rec.evict_branches_after, rec.pool_idx) == (False, False, None, -1)
