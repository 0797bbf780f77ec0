"""What the per-request hooks are handed and return: a request's state, a prefill chunk, a step, an observation
window, a keep plan, a tree payload. Positions are always *logical* (the token's index in the request, its RoPE
position); which pool slot holds one is the runtime's business (docs/architecture.md)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class Family(enum.StrEnum):
    """What a method does to the KV cache (reported in ``/server_info``)."""

    DENSE = "dense"
    EVICTION = "eviction"
    SELECTION = "selection"
    COMPRESSION = "compression"
    QUANTIZATION = "quantization"


@dataclass
class RequestState:
    """Per-request state a method owns. Created by :meth:`SparseMethod.new_state`.

    ``logical_len``: tokens whose K/V exist (prompt processed so far + decoded). ``num_kept``: how
    many of them are physically retained. ``kept``: the sorted int64 CPU tensor of retained logical
    positions. The runtime keeps both on the host from what it applied (no device sync): the kept
    set is a sorted base plus the contiguous tail appended since the last :class:`KeepPlan`, built
    on demand. Methods put their own statistics (scores, page summaries) in ``extra``.
    """

    rid: str
    logical_len: int = 0
    num_kept: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    _base: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64), repr=False)
    _tail_start: int = field(default=0, repr=False)
    # The logical length from which this request's K/V were computed under a sparse view: its first applied plan
    # that dropped positions, or a restored prefix with hidden positions. None: every position it computed saw
    # its whole prefix. The tree keeps it with the finished sequence, so a dense match never reads such K/V.
    sparse_from: int | None = None

    @property
    def kept(self) -> torch.Tensor:
        if self._tail_start >= self.logical_len:
            return self._base
        return torch.cat([self._base, torch.arange(self._tail_start, self.logical_len)])

    @property
    def tail_start(self) -> int:
        """The logical length when the kept set was last set (a plan applied, or the matched prefix
        restored): every position from there on is retained, so for any ``d >= tail_start`` the kept
        set restricted to ``[0, d)`` is exactly the state this request had at length ``d``."""
        return self._tail_start

    def advance(self, new_tokens: int) -> None:
        """Runtime: ``new_tokens`` were appended and are retained."""
        self.logical_len += new_tokens
        self.num_kept += new_tokens

    def set_kept(self, kept: torch.Tensor, logical_len: int | None = None) -> None:
        """Runtime: a :class:`KeepPlan` was applied (or a matched prefix restored, with its length)."""
        if logical_len is not None:
            self.logical_len = logical_len
        if self.sparse_from is None and int(kept.numel()) < self.logical_len:
            self.sparse_from = self.logical_len
        self._base = kept.to(dtype=torch.int64, device="cpu")
        self._tail_start = self.logical_len
        self.num_kept = int(self._base.numel())


@dataclass(frozen=True)
class PrefillChunk:
    """One chunk of a (possibly chunked) prefill: logical positions ``[start, end)`` of ``total``."""

    start: int
    end: int
    total: int

    @property
    def is_final(self) -> bool:
        return self.end == self.total


AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the TP group; returns the sum
MaxOverRanks = Callable[[torch.Tensor], torch.Tensor]  # the element-wise maximum over the TP group's ranks


@dataclass(frozen=True)
class ObservationWindow:
    """The end of a prompt (or of the decoded tokens), for methods that score the retained keys with the last
    queries (SnapKV).

    ``queries[layer]``: post-RoPE queries of the last ``w`` tokens, ``[w, n_heads, head_dim]``, at logical
    positions ``q_pos``. The retained keys (the window's included) are rows ``key_rows`` (``[n]`` int64, on the
    buffer's device) of ``key_buffer(layer)`` (``[N, n_kv_heads, head_dim]``; on a server the KV pool's whole key
    buffer, so a kernel reads them in place), at sorted logical positions ``k_pos`` (``[n]``, CPU).
    ``keys(layer)`` gathers them, for plain-torch methods.

    Under tensor parallelism this rank holds a shard of the heads: ``queries`` and the keys are its heads only,
    and ``all_reduce`` sums a tensor over the TP group (``None``: one rank holds every head). A method that
    derives from :class:`~sgl_sparse.methods.eviction.base.ScoredEviction` never calls it: the base reduces the
    scores it returns, so every rank keeps the same set.
    """

    queries: dict[int, torch.Tensor]
    q_pos: torch.Tensor
    key_buffer: Callable[[int], torch.Tensor]
    key_rows: torch.Tensor
    k_pos: torch.Tensor
    num_layers: int
    scale: float  # the attention softmax scale (1/sqrt(head_dim) for Llama)
    all_reduce: AllReduce | None = None

    def keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """That layer's retained keys ``[n, n_kv_heads, head_dim]`` (a copy) and their positions."""
        return self.key_buffer(layer)[self.key_rows], self.k_pos


@dataclass(frozen=True)
class StepInfo:
    """End of a forward step for one request. ``new_tokens`` logical positions were appended."""

    is_prefill: bool
    new_tokens: int
    decoded_tokens: int  # output tokens so far (for decode-interval triggers)
    final_prefill: bool = False  # this step completed the prompt
    # For a method whose ``needs_token_ids()`` is true (SkipKV finds sentence boundaries in them), None
    # otherwise: ``token_ids(start, end)`` gives the ids the runtime knows at logical positions
    # ``[start, end)``, a prefix of them (possibly empty). The server's step knows every id whose K/V it wrote
    # (a decode token's step runs after SGLang appended the sampled token); a method must still take a prefix (a
    # driver may know the newest id a step late). Valid during the hook call only.
    token_ids: Callable[[int, int], Sequence[int]] | None = None
    # Tensor parallelism: a score that is a maximum over heads (KVzip's replays) holds only this rank's heads;
    # ``max_over_ranks`` takes its element-wise maximum over the TP group (every rank then holds the same scores
    # and keeps the same set). The same call on every rank, decided from replicated data only (lengths, step
    # counts, earlier keep sets). ``None``: one rank holds every head.
    max_over_ranks: MaxOverRanks | None = None


@dataclass(frozen=True)
class KeepPlan:
    """Physical eviction: the sorted logical positions to keep (layer- and head-uniform).

    The runtime frees every other retained slot the request owns and hides tree-owned ones from the
    request's view. Must be a subset of the current ``RequestState.kept``.
    """

    keep: torch.Tensor


@dataclass
class TreePayload:
    """What a finished request leaves in the prefix tree beside its (possibly compacted) KV, e.g.
    accumulated scores aligned with ``RequestState.kept``, for the next turn's :meth:`restore_state`."""

    data: dict[str, torch.Tensor] = field(default_factory=dict)
