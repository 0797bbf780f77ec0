"""Compression and quantization (KIVI, FP8, TurboQuant, ...): a :class:`KVStore` owns how every layer's K/V is laid
out in the pool, written and read back by attention.

The server drives it from SGLang's pool and attention backend: its ``write`` runs wherever SGLang stores a layer's
K/V (prefill and decode), its ``decode`` is every layer's decode attention and its ``prefix`` the cached-prefix part
of every extend. An eviction method over a store (a composition, :mod:`sgl_sparse.compose`) is served when the
store's layout can lose single tokens (:meth:`KVStore.eviction_problem`); a store beside selection is refused at
launch for now.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from sgl_sparse.contract.geometry import KVGeometry
from sgl_sparse.contract.model import ModelKV
from sgl_sparse.store_reads import PrefixReadPolicy, attend, read_in_pieces


class KVStore(PrefixReadPolicy, ABC):
    """Method-owned K/V storage (the quantization and compression families): the layout of every
    layer's K/V in the pool, how the write path stores it, and how attention reads it back without
    materializing a dequantized layer.

    The server builds SGLang's KV pool around it (``integration/kv_pool.py``): SGLang's memory planner
    sizes the pool from :meth:`bytes_per_token` (fewer bytes, more tokens), :meth:`allocate` creates
    the buffers for that many slots, wherever SGLang stores a layer's post-RoPE K/V :meth:`write`
    encodes it, and attention reads only through :meth:`decode` (a decode step, inside CUDA graphs:
    device only, fixed shapes, no host sync) and :meth:`prefix` (an extend step: the new tokens'
    queries over their cached prefix; the new tokens attend to each other as the layout stores them,
    :meth:`round_trip`). Everything is indexed by physical slot and written once by the slot's
    owner, so a prefix shared through the radix tree is read back exactly as it was written.

    The defaults of :meth:`decode` and :meth:`prefix` are the plain-torch reference (dequantize the
    row through :meth:`read`, then attend): the CPU path, and what a store's kernels are tested
    against.

    Under an evicting method (a composition) the rows :meth:`decode` and :meth:`prefix` read are compacted:
    each holds only its request's live slots, in position order, packed to the front, and its row index is
    the request's place in the batch, not its ``req_pool_idx``. Evicted slots are freed one at a time and
    reused by other requests. So a layout can serve under eviction only if nothing it reads is tied to a
    logical position, a request row or a group of slots (:meth:`eviction_problem`).

    How an extend reads its cached prefix (dequantized through the base's dense prefill, or through
    :meth:`prefix`) is serving policy, inherited from :class:`~sgl_sparse.store_reads.PrefixReadPolicy`: a
    store calls ``choose_prefix_attention`` with its config's ``prefix_attention`` and adds
    ``describe_prefix_attention()`` to :meth:`describe`.
    """

    page_size: int = 1  # pool page size the layout needs (a group of tokens never straddles two owners)
    # Whether decode and prefix run as device kernels (CUDA-graph safe): the torch defaults below loop over
    # requests with host reads, so a store without kernels serves on CPU only.
    gpu_kernels: ClassVar[bool] = False
    # Why a slot's data cannot be copied to another slot alone (None: :meth:`slot_tensors` is all of it). SGLang
    # moves slots only for speculative decoding, which the launcher refuses; the pool raises this if it ever does.
    slot_move_problem: ClassVar[str | None] = None
    # Whether the layout derives from the model's weights (:meth:`load_model`, before :meth:`allocate`).
    needs_model: ClassVar[bool] = False
    # Whether a token's encoding depends on earlier tokens of its request, which the store then finds through the
    # row it was handed (:meth:`attach_rows`): an extend writes its new tokens first and reads them back from the
    # pool (:meth:`read`) for their own attention, instead of :meth:`round_trip` (which sees only the new tokens).
    reads_back_new_tokens: ClassVar[bool] = False
    # Whether a token is encoded from all of its KV heads together (DeltaKV's compressor), so a tensor-parallel rank,
    # which holds a share of the heads, cannot encode it.
    reads_whole_tokens: ClassVar[bool] = False

    @property
    def encoding_group(self) -> int:
        """Tokens stored together as one group (KIVI's keys per channel): an extend reads a cached prefix's whole
        groups only and its open group beside the new tokens. The page size by default; 1 for a layout whose pages
        only keep a request's tokens together (DeltaKV's centres)."""
        return self.page_size

    def attach_rows(self, req_to_token: torch.Tensor) -> None:
        """SGLang's ``req_to_token`` (rows by ``req_pool_idx``), handed over once the pools exist, for a layout that
        reads a request's earlier slots when it writes (``reads_back_new_tokens``)."""
        return None

    @abstractmethod
    def bytes_per_token(self, geometry: KVGeometry) -> int:
        """Device bytes per KV token over all ``geometry.num_layers`` layers (K, V, their scales)."""

    def fixed_bytes(self, geometry: KVGeometry) -> int:
        """Device bytes that do not grow with tokens (e.g. a per-request residual for
        ``geometry.max_requests`` rows), taken from SGLang's KV budget before the pool is sized."""
        return 0

    def load_model(self, model: ModelKV) -> None:
        """The loaded model's K/V projections and rotary table (``needs_model`` stores; before :meth:`allocate`).
        Raise ``ValueError`` saying why for a model the layout cannot serve."""
        return None

    @abstractmethod
    def allocate(self, geometry: KVGeometry) -> None:
        """Allocate the buffers for ``geometry.num_slots`` slots (once, as SGLang builds its pool)."""

    @abstractmethod
    def slot_tensors(self, layer_id: int) -> list[torch.Tensor]:
        """Every per-slot tensor of a layer (leading dim: slots), the K codes first and the V codes
        second: the pool lists the first two as its K/V buffers and all of them as what a slot move copies."""

    @abstractmethod
    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              decode: bool, positions: torch.Tensor | None = None) -> None:
        """Encode ``k``/``v`` (``[n, Hkv, D]``, post-RoPE, model dtype) into slots ``loc`` (``[n]``); ``rows``
        (``[n]``) is each token's ``req_pool_idx``, for layouts that keep a request's unfinished group of
        tokens aside (KIVI's residual); ``positions`` (``[n]``) each token's position, which the server always
        passes (a layout of pre-rotary K needs it). ``decode``: one token per row, maybe inside a CUDA graph (device
        only, no host sync); else an extend step's tokens, each row's in position order."""

    @abstractmethod
    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V of ``slots`` (``[n]``): ``[n, Hkv, D]`` each, in the model dtype."""

    @abstractmethod
    def round_trip(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``/``v`` ``[n, Hkv, D]`` (model dtype) as the layout's attention reads them once stored: as :meth:`read`
        gives them back, bit for bit (a layout whose scores add a term linear in the query, TurboQuant's QJL, adds it
        to the keys); each
        token alone for a per-token layout; for a grouped one (``page_size`` G > 1) ``n`` is a multiple of G and
        each run of G tokens is one whole group. An extend's new tokens read each other through it
        (``integration/store_attention.py``): a query reads every key as the layout serves it, whichever prefill
        chunk holds the key, so where other traffic cuts a prompt into chunks cannot change its answer. Per-token
        layouts: every key as stored, the query's own included (as a decode step, which writes first, reads it);
        grouped ones: the whole groups before the query's own as stored, its own group at full precision (the
        open group a grouped layout keeps aside, :meth:`read_open`), or as stored when the query is the group's last
        token: in each case what a decode step at the query's position reads."""

    def read_open(self, layer_id: int, rows: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A grouped layout's open group, at full precision: the tokens at ``offsets`` (``[n]``, within the group) of
        the open groups of request rows ``rows`` (``[n]``) -> K, V ``[n, Hkv, D]`` in the model dtype. An extend
        whose cached prefix ends inside a group reads the group's earlier tokens here."""
        raise NotImplementedError(f"{type(self).__name__} keeps no open group (page size {self.page_size})")

    def read_prefix(self, layer_id: int, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    prefix_lens: torch.Tensor, lens: list[int],
                    slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend step's cached prefixes dequantized, flat (:attr:`dequantize_prefix`): the first ``lens[i]``
        positions (also on the device: ``prefix_lens``) of row ``req_to_token[req_pool_indices[i]]``, request after
        request -> K, V ``[sum(lens), Hkv, D]`` in the model dtype. ``slots``: those positions' slots, flat. The
        default reads ``slots`` through :meth:`read`, a piece at a time (a read's fp32 temporaries must not
        scale with a 100K-token prefix); a layout with per-request state (KIVI's residual) reads its own way."""
        return read_in_pieces(self.read, layer_id, slots)

    def describe(self) -> dict[str, Any]:
        """What ``/server_info`` reports of the layout (e.g. bits); JSON values."""
        return {}

    def read_keys(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """Dequantized K of ``slots``, ``[n, Hkv, D]``: what an evicting method's scores read (SnapKV's window)."""
        return self.read(layer_id, slots)[0]

    def eviction_problem(self) -> str | None:
        """Why an evicting method cannot run over this layout (``None``: it can). Eviction frees single slots
        and leaves each request's kept slots wherever they were written, read through compacted rows (class
        docstring). The default accepts a per-token layout (page size 1, no per-request buffers)."""
        if self.page_size != 1:
            return (f"its layout groups {self.page_size} tokens per page (--page-size {self.page_size}), and "
                    "eviction frees single tokens")
        if type(self).fixed_bytes is not KVStore.fixed_bytes:
            return "it keeps per-request buffers beside the pool, indexed by request row and logical position"
        return None

    def row_attention(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, row: int, n: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference both defaults below are made of: ``q`` ``[m, Hq, D]`` over the first ``n``
        positions of row ``row`` (``n > 0``), no mask -> (output, natural log-sum-exp ``[m, Hq]``). Override it
        for layouts that read a row otherwise (a residual) or score otherwise (QJL)."""
        k, v = self.read(layer_id, req_to_token[row, :n].long())
        return attend(q, k, v, scale)

    def decode(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention, this step's K/V written: ``q`` ``[bs, Hq, D]`` over the first ``seq_lens[i]``
        slots of each row ``req_to_token[req_pool_indices[i]]`` -> ``[bs, Hq, D]`` (an empty row gives 0)."""
        out = torch.zeros_like(q)
        for i, (r, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
            if n > 0:
                out[i] = self.row_attention(layer_id, q[i:i + 1], req_to_token, r, n, scale)[0][0]
        return out

    def prefix(self, layer_id: int, q: torch.Tensor, qo_indptr: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: list[int],
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend step's queries over their cached prefix: request ``i``'s new tokens
        (``q[qo_indptr[i]:qo_indptr[i + 1]]``, ``[n, Hq, D]``; their counts ``extend_lens`` also on the host, as
        an extend step knows them without a sync) over the first ``prefix_lens[i]`` slots of its row
        ``req_to_token[req_pool_indices[i]]``, no mask (every prefix token precedes every new one) ->
        (output ``[n, Hq, D]``, fp32 natural log-sum-exp of the logits ``[n, Hq]``, ``-inf`` for an empty
        prefix), to be merged with the new tokens' own attention."""
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        at = 0
        for r, n, m in zip(req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens, strict=True):
            if n > 0 and m > 0:
                out[at:at + m], lse[at:at + m] = self.row_attention(layer_id, q[at:at + m], req_to_token, r, n, scale)
            at += m
        return out, lse
