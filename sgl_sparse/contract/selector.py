"""Dynamic selection (Quest, OmniKV, RetroInfer): a :class:`PageSelector` picks, per decode step, layer and KV head,
the pages attention reads, batched over the whole step on the device.

The server drives it per layer inside each forward, in layer order (there are no per-request per-layer hooks:
per-request Python per layer cannot run inside a CUDA-graph replay): ``on_kv_write`` wherever a selecting layer's
K is written (prefill and decode); in decode, ``select`` before a selecting layer's attention (or, for a selector
that ``attends``, ``attend`` instead of it) and ``observe`` after an observing (dense) layer's attention; then, for a
selector that ``maintains``, ``after_step`` once after each forward step (prefill and decode, outside CUDA graphs,
every layer's K/V in the pool).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_sparse.contract.geometry import KVGeometry
from sgl_sparse.contract.state import RequestState


@dataclass(frozen=True)
class SelectorStep:
    """What :meth:`PageSelector.after_step` sees of a finished forward step: the batch's rows
    (``req_pool_indices``, device), each row's logical length before and after the step (CPU int64,
    known to the scheduler without a sync), the ``req_to_token`` table and each layer's K/V pool
    (``kv(layer) -> (k, v)``, ``[slots, Hkv, D]``)."""

    req_pool_indices: torch.Tensor
    old_lens: torch.Tensor
    new_lens: torch.Tensor
    req_to_token: torch.Tensor
    kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class PageSelector(ABC):
    """Dynamic selection for a whole decode batch, on the device (the server drives it).

    Each selecting layer of a decode step: the runtime writes the step's K/V, calls
    :meth:`on_kv_write` with it, then :meth:`select` with the batch's post-RoPE queries; attention
    then reads, for each (request, KV head), only the tokens of the pages selected. Every call sees
    fixed-shape device tensors and must not sync with the host (it runs inside CUDA-graph replays,
    where the batch has no request ids): per-request choices are data, e.g. a row with fewer pages
    than the selection width selects all of them (dense). Prefill writes also go through
    :meth:`on_kv_write` (prefill attention stays dense).

    A *page* is ``page_size`` consecutive logical positions of a request: with SGLang's paged
    allocator (``--page-size page_size``, which the launcher sets) one physical page, so metadata
    indexed by physical page (``slot // page_size``) is written by one owner in order and is shared,
    exact, with every request that matches it through the prefix tree.

    The metadata's memory is the method's: :meth:`metadata_bytes_per_token` is added to SGLang's KV
    cell size before the pool is sized, so the pool shrinks by what :meth:`allocate` then takes.

    A selector either returns pages (:meth:`select`, :attr:`pages_per_row`; the server's attention
    kernels read them) or, when ``attends``, computes the selecting layers' decode attention itself
    (:meth:`attend`: for reads that are not a list of tokens, e.g. RetroInfer's estimated clusters).
    One that ``maintains`` also gets :meth:`after_step` (e.g. to build an index over K/V that a
    step completed).

    A ``static`` selector's selection does not depend on the query (:meth:`select` does not read ``q``,
    which may be ``None``): it is per request and layer, set between steps by its method (PyramidKV's
    per-layer keep sets) and handed to the request's row in :meth:`bind`. Its selection is also what an
    extend step's queries read of their cached prefix (the CPU server), not only decode.
    """

    page_size: int
    attends: ClassVar[bool] = False
    maintains: ClassVar[bool] = False
    static: ClassVar[bool] = False

    @abstractmethod
    def selects(self, layer_id: int) -> bool:
        """Whether decode attention of this layer reads a selection (else all of the KV)."""

    @property
    def pages_per_row(self) -> int:
        """How many pages each (request, KV head) selects at most: the static width of :meth:`select`."""
        return 0

    def metadata_bytes_per_token(self, geometry: KVGeometry) -> int:
        """Device bytes of method metadata per KV token (rounded up), counted in SGLang's pool sizing."""
        return 0

    def fixed_bytes(self, geometry: KVGeometry) -> int:
        """Device bytes of per-request buffers (``geometry.max_requests`` rows), taken from the KV budget before
        the pool is sized (e.g. PyramidKV's per-layer sets)."""
        return 0

    def allocate(self, geometry: KVGeometry) -> None:
        """Allocate the metadata buffers (once, after the KV pool, before CUDA-graph capture);
        ``geometry.max_requests`` is the number of ``req_to_token`` rows."""
        return None

    def on_kv_write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, decode: bool = False) -> None:
        """K (post-RoPE, ``[n, Hkv, D]``) was written at slots ``loc`` (``[n]``) of a selecting layer.
        ``decode``: a decode step's write, one new token per request, so no two slots of ``loc`` share a page
        but SGLang's padding page 0 (CUDA-graph padding rows): per-page metadata may be updated in place
        without a reduction over the slots."""
        return None

    def observes(self, layer_id: int) -> bool:
        """Whether this dense (non-selecting) layer's decode queries and keys feed later selections."""
        return False

    def observe(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """After an observing layer's dense decode attention (this step's K written): ``q`` ``[bs, Hq, D]``,
        ``k_cache`` the layer's whole K pool ``[slots, Hkv, D]``; e.g. OmniKV picks here the tokens
        the following layers read. Same rules as :meth:`select` (device only, no host sync)."""
        return None

    def select(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
        """Pages to read: ``[bs * Hkv, pages_per_row]`` int64, row ``i * Hkv + h``; each row ascending,
        ending with the request's last page (the one being written), unused entries last and at least
        the request's page count. ``q``: ``[bs, Hq, D]``; ``seq_lens``: ``[bs]``, this token included."""
        raise NotImplementedError(f"{type(self).__name__} attends itself (attend), it returns no pages")

    def attend(self, layer_id: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        """A selecting layer's decode attention (``attends`` selectors), this step's K/V written:
        ``q`` ``[bs, Hq, D]`` -> ``[bs, Hq, Dv]``; ``k_cache``/``v_cache`` the layer's whole pool. Same rules
        as :meth:`select` (device only, no host sync, fixed shapes)."""
        raise NotImplementedError(f"{type(self).__name__} returns pages (select), it does not attend")

    def after_step(self, step: SelectorStep) -> None:
        """After a forward step (``maintains`` selectors; batched over the step's rows, outside CUDA
        graphs, no host sync needed: the lengths are on the host)."""
        return None

    def bind(self, states: Sequence[RequestState | None], rows: Sequence[int]) -> None:
        """Before each forward step (eager or a CUDA-graph replay; called outside the graph, on the host), for a
        ``static`` selector (its rows hold what its method decided per request): the step's requests' states
        (``None``: a request the method does not track) and their ``req_to_token`` rows (host ints), in batch
        order. What a method hands its selector lives in the request's state, which owns it; device writes go
        through pinned memory without a sync (``slots.to_device``)."""
        return None
