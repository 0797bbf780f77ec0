"""Per-request tables on the device, indexed by ``req_pool_idx`` (the row of ``req_to_token``).

The retained index table is ``req_to_token`` itself: position ``p`` of a request's row holds its slot,
or ``SENTINEL_SLOT`` once evicted; the tree and the attention lists read it there, so there is no
second copy to keep in step. Beside it lives ``live_len[row]``, the row's live slot count for the
decode step about to run (its retained set plus this step's token). The decode KV lists are built from
it in one pass (``fill_compact_kv_indices(counts=...)``: no counting scan of the logical row, which is
130K entries at 130K context), by kernels that index it with the batch's device ``req_pool_indices``,
so the build also runs inside CUDA-graph replays.

The host keeps the same counts (``RequestState.num_kept``) and decides from them without a sync;
``set_decode`` copies the decode batch's counts once per step (pinned, non-blocking) on the stream the
forward runs on, so they are in place before the step's metadata build reads them. Row 0 is SGLang's
padding row (the request pool never hands it out): it counts 0, and ``min_one`` gives a CUDA-graph
padding row its single padding slot, as the counting kernel would.
"""

from __future__ import annotations

import os

import torch

from sgl_sparse.slots import SENTINEL_SLOT, to_device

# Tests and debugging: after each copy, check the device counts against the rows (a host sync).
CHECK_ENV = "SGLSPARSE_CHECK_TABLES"


class DeviceTables:
    def __init__(self) -> None:
        self.live_len: torch.Tensor | None = None
        # Whether ``live_len`` holds the counts of the decode batch being run (set before its forward,
        # cleared after): the metadata build uses them only then.
        self.decode_ready = False
        self.check = os.environ.get(CHECK_ENV) == "1"

    def set_decode(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor,
                   seq_lens: list[int]) -> None:
        """``lens`` (CPU int32, batch order): live counts of the batch's rows for this decode step;
        ``seq_lens``: their logical lengths (only for the check)."""
        if self.live_len is None or self.live_len.device != req_to_token.device:
            self.live_len = torch.zeros(req_to_token.shape[0], dtype=torch.int32, device=req_to_token.device)
        rows = req_pool_indices[: lens.numel()].long()
        self.live_len[rows] = to_device(lens, req_to_token.device)
        self.decode_ready = True
        if self.check:
            self._check(req_to_token, rows, lens, seq_lens)

    def decode_counts(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                      min_one: bool) -> torch.Tensor | None:
        """Counts for a decode list build (``[bs]``, device), or None when this step has none."""
        if not self.decode_ready or self.live_len is None:
            return None
        counts = self.live_len[req_pool_indices.long()]
        if min_one:
            counts = torch.maximum(counts, torch.clamp(seq_lens, max=1).to(counts.dtype))
        return counts

    def done(self) -> None:
        self.decode_ready = False

    def _check(self, req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, seq_lens: list[int]) -> None:
        for row, n, seq_len in zip(rows.tolist(), lens.tolist(), seq_lens):
            live = int((req_to_token[row, :seq_len] != SENTINEL_SLOT).sum())
            if live != n:
                raise AssertionError(f"sgl_sparse: row {row} holds {live} live slots, the host counts {n}")
