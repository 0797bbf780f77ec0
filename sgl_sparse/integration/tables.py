"""Per-request tables on the device, indexed by ``req_pool_idx`` (the row of ``req_to_token``).

The retained index table is ``req_to_token`` itself: position ``p`` of a request's row holds its slot,
or ``SENTINEL_SLOT`` once evicted; the tree and the attention lists read it there, so there is no
second copy to keep in step. Beside it lives ``live_len[row]``, the row's live slot count for the
decode step about to run (its retained set plus this step's token). The decode KV lists take their
lengths from it (``fill_compact_kv_indices(counts=...)``), indexed with the batch's device
``req_pool_indices``, so they equal the host-side lengths FlashInfer's CUDA-graph decode plan uses
(from the same host counters) by construction, and the build also runs inside CUDA-graph replays.

The host keeps the same counts (``RequestState.num_kept``) and decides from them without a sync;
``set_decode`` copies the decode batch's counts once per step (pinned, non-blocking) on the stream the
forward runs on, so they are in place before the step's metadata build reads them. Row 0 is SGLang's
padding row (the request pool never hands it out): it counts 0, and ``min_one`` gives a CUDA-graph
padding row its single padding slot, as it does to a counted row.

The list build still counts each row's live slots (it needs them to place the slots) and adds every
row whose table count differs to ``mismatches``, on the device. After each decode step that counter
is copied to pinned host memory without blocking; the next step reads the copy once its event has
completed, so a host bookkeeping error is logged and reported (``/server_info``
``decode_count_mismatches``) without a sync, instead of silently changing what attention reads.
"""

from __future__ import annotations

import logging
import os

import torch

from sgl_sparse.integration.syncs import allow_host_sync
from sgl_sparse.slots import SENTINEL_SLOT, to_device

logger = logging.getLogger(__name__)

# Tests and debugging: after each copy, check the device counts against the rows (a host sync).
CHECK_ENV = "SGLSPARSE_CHECK_TABLES"


class DeviceTables:
    def __init__(self) -> None:
        self.live_len: torch.Tensor | None = None
        # Whether ``live_len`` holds the counts of the decode batch being run (set before its forward,
        # cleared after): the metadata build uses them only then.
        self.decode_ready = False
        self.check = os.environ.get(CHECK_ENV) == "1"
        self.mismatches: torch.Tensor | None = None  # device, rows whose table count was wrong (cumulative)
        self.mismatches_seen = 0  # the last value read back on the host
        self._readback: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def set_decode(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor,
                   seq_lens: list[int]) -> None:
        """``lens`` (CPU int32, batch order): live counts of the batch's rows for this decode step;
        ``seq_lens``: their logical lengths (only for the check)."""
        self.read_mismatches()
        if self.live_len is None or self.live_len.device != req_to_token.device:
            self.live_len = torch.zeros(req_to_token.shape[0], dtype=torch.int32, device=req_to_token.device)
            self.mismatches = torch.zeros(1, dtype=torch.int64, device=req_to_token.device)
        rows = req_pool_indices[: lens.numel()].long()
        self.live_len[rows] = to_device(lens, req_to_token.device)
        self.decode_ready = True
        if self.check:
            with allow_host_sync():  # this check reads the rows on the host, on purpose
                self._check(req_to_token, rows, lens, seq_lens)

    def decode_counts(self, req_pool_indices: torch.Tensor) -> torch.Tensor | None:
        """Live counts of a decode list build's rows (``[bs]``, device), or None when this step has none."""
        if not self.decode_ready or self.live_len is None:
            return None
        return self.live_len[req_pool_indices.long()]

    def done(self) -> None:
        """After the step's forward: start the non-blocking read-back of the mismatch counter."""
        if self.decode_ready and self.mismatches is not None and self._readback is None:
            host = torch.empty(1, dtype=torch.int64, pin_memory=self.mismatches.is_cuda)
            host.copy_(self.mismatches, non_blocking=True)
            event = None
            if self.mismatches.is_cuda:
                event = torch.cuda.Event()
                event.record()
            self._readback = (host, event)
        self.decode_ready = False

    def read_mismatches(self) -> int:
        """The mismatch count read back so far (takes in a completed read-back; never waits)."""
        if self._readback is None:
            return self.mismatches_seen
        host, event = self._readback
        if event is not None and not event.query():
            return self.mismatches_seen  # not there yet: read it at a later step
        self._readback = None
        n = int(host[0])
        if n > self.mismatches_seen:
            logger.error("sgl_sparse: %d decode row(s) had a live count that differs from their req_to_token row "
                         "(%d in all); their attention read a truncated or padded KV list. This is a bug: please "
                         "report it with the server log", n - self.mismatches_seen, n)
            self.mismatches_seen = n
        return self.mismatches_seen

    def _check(self, req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, seq_lens: list[int]) -> None:
        for row, n, seq_len in zip(rows.tolist(), lens.tolist(), seq_lens):
            live = int((req_to_token[row, :seq_len] != SENTINEL_SLOT).sum())
            if live != n:
                raise AssertionError(f"sgl_sparse: row {row} holds {live} live slots, the host counts {n}")
