"""One record per request: everything sgl_sparse knows about a request, in one place.

A :class:`SparseRequest` is made when the request is admitted (``SparseRuntime.admit``, before it first enters
SGLang's waiting queue) and reached from SGLang's ``Req`` through its one handle attribute, :data:`HANDLE`. It
holds the method that serves the request (and its prefix-tree fingerprint), the request's own prune, the tree's
match view, and, once its first forward step ran (:meth:`SparseRequest.start`), the method's
:class:`~sgl_sparse.contract.RequestState`, its row of ``req_to_token`` (the slot of the per-request device tables),
its captured window queries and the step's flags. At finish the running part is dropped (:meth:`SparseRequest.stop`),
so a retracted request that comes back starts again from a new match.

Python touches a record at admission, at a prefill chunk, at a decode step's host counters and at finish; the
device side (live counts, sentinels) is batched by ``req_pool_idx`` (integration/tables.py, slots.py).

SGLang-free: the integration side (integration/runtime.py) creates and drives records; the radix tree stores its
match view here (:func:`set_match_view`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sgl_sparse.contract import RequestState, SparseMethod
from sgl_sparse.radix.records import VIEW_ATTR, MatchView

if TYPE_CHECKING:
    from sgl_sparse.prune.spec import PruneSpec
    from sgl_sparse.request_methods import Served

HANDLE = "sgl_sparse"  # the one attribute sgl_sparse sets on SGLang's Req
# The customized_info key that carries a request's own prune outcome from the scheduler (integration/step.py) to
# its response (integration/per_request.py).
PRUNE_REPORT = "sgl_sparse_prune_report"


@dataclass(eq=False)
class WindowCapture:
    """The last queries of a request, per layer, as the attention backend records them (integration/capture.py):
    its ``window`` (> 0), whether decode queries are captured too (then they live in the server's device ring,
    from ``ring_from`` on), else layer -> ``[n <= window, H, D]``."""

    window: int
    observes_decode: bool
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt-only capture
    ring_from: int = -1  # decode capture: the first position written to the device ring (-1: none yet)


@dataclass(eq=False)
class SparseRequest:
    """A request's sgl_sparse state (module doc). Made at admission; the fields below ``view`` are set by the
    first forward step (:meth:`start`) and dropped at finish (:meth:`stop`)."""

    rid: str
    served: Served  # the method serving it and its prefix-tree namespace (request_methods.py)
    prune: PruneSpec | None = None  # its own prune (custom_params sgl_sparse_prune), identical on every TP rank
    # What its match in the tree gives it (set by the tree at each match; read when its first step starts).
    view: MatchView | None = None
    state: RequestState | None = None  # its method's state; None until its first forward step
    pool_idx: int = -1  # its row of req_to_token: the slot of the per-request device tables
    capture: WindowCapture | None = None  # its window queries, while they can still be observed
    prompt_done: bool = False  # its final prefill chunk ran: later steps are decode tokens
    pruned: bool = False  # its own prune hid positions (the tree then treats cached continuations as a prune does)
    # Its own prune asked for evict_branches and hid positions: at finish the tree evicts the idle branches off its
    # path from this logical position (the first range's start) before freeing what it hid.
    evict_branches_after: int | None = None

    @property
    def method(self) -> SparseMethod[Any]:
        return self.served.method

    @property
    def started(self) -> bool:
        return self.state is not None

    @property
    def running_state(self) -> RequestState:
        """Its method's state, for code that runs only between :meth:`start` and :meth:`stop`."""
        assert self.state is not None, f"sgl_sparse: request {self.rid} has not started"
        return self.state

    def start(self, state: RequestState, pool_idx: int) -> None:
        self.state = state
        self.pool_idx = pool_idx

    def stop(self) -> None:
        """Finished, aborted or retracted: drop what its run held (a retracted request starts again)."""
        self.state = None
        self.pool_idx = -1
        self.capture = None
        self.prompt_done = self.pruned = False
        self.evict_branches_after = None


def record_of(req: Any) -> SparseRequest | None:
    """The record of SGLang's ``req`` (None before admission)."""
    return getattr(req, HANDLE, None)


def attach(req: Any, record: SparseRequest) -> None:
    setattr(req, HANDLE, record)


def set_match_view(req: Any, view: MatchView) -> None:
    """The tree's match of ``req``: on its record, or, on a probe that carries none (the tree's own probes ask what
    is cached with a stand-in request; tests' stand-ins), at :data:`~sgl_sparse.radix.records.VIEW_ATTR`."""
    rec = record_of(req)
    if rec is not None:
        rec.view = view
    else:
        setattr(req, VIEW_ATTR, view)


def match_view(req: Any) -> MatchView | None:
    """The last match view the tree left for ``req`` (:func:`set_match_view`)."""
    rec = record_of(req)
    return rec.view if rec is not None else getattr(req, VIEW_ATTR, None)
