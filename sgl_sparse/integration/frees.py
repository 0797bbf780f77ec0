"""Slots an eviction step frees, and its row writes, ordered against SGLang's schedule stream.

With overlap scheduling (the default on CUDA) the forward of batch N runs on the forward stream while
the scheduler prepares batch N+1 on its schedule stream, whose allocator calls read
``allocator.free_pages``. Our eviction step is enqueued on the forward stream (a prefill chunk's right
after its forward is launched; a decode token's once the previous results are processed, before the next
launch: integration/step.py): its sentinel writes and slot gathers are ordered after the forward there.
Handing the slots to the allocator from the forward stream would race the schedule stream's next
``alloc`` (and its tree reads of the rows), so the slots wait here with an event recorded after our
writes, and the schedule stream waits for that event (a GPU-side wait, no host sync) and frees them:
for a prefill step at ``Scheduler._apply_war_barrier``, which runs right after each launch on the
schedule stream (our AFTER hook there); for a deferred decode step right after it runs, from around
``Scheduler.process_batch_result`` on the schedule stream (or at the barrier after the next launch
where it runs before that forward). The event is recorded for every step that wrote sentinels, also when it freed
nothing (all dropped positions tree-owned): SGLang's barrier may wait only for the decode graph's
reads, and a row released after this step can be handed to the next request, whose prefix the
schedule stream writes into it. Without overlap (or on CPU) there is one stream and slots are freed
at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class PendingFrees:
    deferred: bool = False  # overlap scheduling on a CUDA device
    pending: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    allocator: Any = None
    _warned: bool = False

    def after_writes(self, allocator: Any, slots: torch.Tensor) -> None:
        """The step wrote sentinels and frees ``slots`` (maybe none)."""
        self.allocator = allocator
        if not self.deferred or not slots.is_cuda:
            if slots.numel():
                allocator.free(slots)
            return
        event = torch.cuda.Event()
        event.record()
        self.pending.append((slots, event))

    def flush_on_current_stream(self) -> None:
        """On the schedule stream (the war-barrier hook, or after a deferred decode step): wait for the eviction
        writes, free."""
        if not self.pending:
            return
        stream = torch.cuda.current_stream()
        for slots, event in self.pending:
            stream.wait_event(event)
            if slots.numel():
                slots.record_stream(stream)  # allocated on the forward stream, read here
                self.allocator.free(slots)
        self.pending.clear()

    def flush_late(self) -> None:
        """A step began with frees still pending (no war barrier ran since): free them on the current
        stream. Correct only when that stream is ordered after the schedule stream's next reads, so
        say it once if it happens."""
        if not self.pending:
            return
        if not self._warned:
            logger.warning("sgl_sparse: evicted slots were not handed back at the schedule-stream barrier; "
                           "freeing them on the forward stream (overlap scheduling path not recognised)")
            self._warned = True
        self.flush_on_current_stream()
