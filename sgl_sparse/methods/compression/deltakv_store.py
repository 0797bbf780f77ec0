"""DeltaKV's layout over the pool (``methods/compression/deltakv.py`` serves it): what a slot of each layer holds, how
a token is written into it and read back.

Layers the compressor has no ``down``/``up`` for are **full**: they keep the post-RoPE K and V as SGLang would.
On a **sparse** layer every slot holds the token's position (int32) and, per page of ``stride`` slots (SGLang's
paged allocator with ``--page-size stride``: a page is ``stride`` consecutive positions of one request, and the
page's first slot is the position that is a multiple of ``stride``), the **centre** is the page's first token:
its raw pre-RoPE ``kv`` (K with the rotation undone, then V, flattened) in a per-page buffer. Every other token
keeps the latent residual ``z = down(kv) - down(c)`` (model dtype) and the slots of its ``neighbors`` nearest
centres (int32, ``-1`` unused): the centres of its own request's pages at positions before it (L2 over ``kv``,
``deltakv_compressor.nearest_centres``), ``c`` their mean. It is read back as ``up(z) + c`` with K rotated again at
its position.

Everything a slot holds is a function of the request's tokens up to and including the slot's position (a centre
is the page's first token, a token's candidates are its request's earlier centres), so a prefix shared through
the radix tree reads back exactly as it was written, whichever request wrote it and however its prompt was cut
into chunks. The tree frees a request's pages from the end, so a page's centre outlives every token pointing at
it; freeing a range in the middle (Prefix-Cache Pruning) would not, and must stay refused for this layout.

The latent is kept in the model dtype (``latent_bits`` 16) or, as the original's int4 option, as 4-bit codes with an
fp16 scale and zero point per group of :data:`LATENT_GROUP` values of a token (asymmetric, min to max; the codes
packed two a byte by ``kernels/quant.py::pack_chunks``).

Per token on a sparse layer: the latent (``latent_dim`` values in the model dtype, or ``latent_dim / 2`` bytes and
4 fp16 a group of 32), ``neighbors`` + 1 int32 and a ``stride``-th of a raw ``kv``; on a Llama-3-8B layer (kv 2,048
wide) at latent 128, 4 neighbours, stride 10: ~682 bytes (~506 at 4 bits) against bf16's 4,096.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sgl_sparse.contract import KVGeometry, KVStore, ModelKV, RotaryTable
from sgl_sparse.kernels.omnikv import score_tokens_torch
from sgl_sparse.kernels.pages import select_pages
from sgl_sparse.kernels.quant import asym_dequantize, asym_quantize, pack_chunks, unpack_chunks
from sgl_sparse.kernels.rope import rotate
from sgl_sparse.methods.compression.deltakv_compressor import (
    Compressor,
    CompressorConfig,
    centre_mean,
    nearest_centres,
)
from sgl_sparse.slots import SENTINEL_SLOT
from sgl_sparse.store_reads import attend

INT32 = 4
LATENT_GROUP = 32  # latent values a 4-bit scale and zero point cover (the original's group)
LATENT_BITS = (4, 16)


class DeltaKVStore(KVStore):
    """Full layers: ``k``/``v`` ``[slots, Hkv, D]``. Sparse layers: ``latent`` ``[slots, latent_dim]`` (at 4 bits
    ``[slots, latent_dim / 2]`` uint8 with ``latent_scale``/``latent_zero`` ``[slots, latent_dim / 32]`` fp16),
    ``pointers`` ``[slots, neighbors]`` int32 (centre slots), ``pos`` ``[slots]`` int32 and ``centre``
    ``[pages, kv_dim]`` (model dtype). :meth:`attach_rows` hands it ``req_to_token``, where a write finds the
    request's earlier centres."""

    needs_model = True
    reads_back_new_tokens = True
    reads_whole_tokens = True
    slot_move_problem = "a compressed token points at its request's centre slots"

    @property
    def encoding_group(self) -> int:
        return 1  # every token is encoded alone when written; a page only keeps one request's tokens together

    def __init__(self, config: CompressorConfig, load: Callable[[], Compressor],
                 prefix_attention: str = "auto", latent_bits: int = 16, keep_tokens: int = 0, sink_tokens: int = 0,
                 recent_tokens: int = 0) -> None:
        """``config``: the compressor's shapes (the pool is sized from them); ``load``: its weights, called in
        :meth:`load_model` (the server's scheduler: torch work in a launcher that forks its children afterwards
        can hang them); ``latent_bits``: 16 (the model dtype) or 4; ``keep_tokens``: what a decode step reads on a
        sparse layer (:meth:`decode`; 0: every token)."""
        if latent_bits not in LATENT_BITS or (latent_bits == 4 and config.latent_dim % LATENT_GROUP):
            raise ValueError(f"deltakv: latent_bits {latent_bits} over a latent of {config.latent_dim}: 16, or 4 "
                             f"where the latent is whole groups of {LATENT_GROUP}")
        self.latent_bits = latent_bits
        self.choose_prefix_attention(prefix_attention)
        self.keep_tokens, self.sink_tokens, self.recent_tokens = keep_tokens, sink_tokens, recent_tokens
        # The decode step's selection, row positions [bs, sink + keep + recent] ascending (past a row's length:
        # unused), made by each full layer and read by the sparse layers after it in the same step.
        self._selected: torch.Tensor | None = None
        self._selected_rows = torch.empty(0, dtype=torch.int64)
        self._load = load
        self.compressor: Compressor | None = None
        self.config = config
        self.page_size = config.stride
        self.stride, self.neighbors = config.stride, config.neighbors
        self.latent_dim, self.kv_dim = config.latent_dim, config.kv_dim
        self.sparse_layers = frozenset(config.layers)
        self.rotary: RotaryTable | None = None
        self.req_to_token: torch.Tensor | None = None
        self.num_kv_heads, self.head_dim = 0, 0
        self.dtype = torch.bfloat16
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.latent: dict[int, torch.Tensor] = {}
        self.latent_scale: dict[int, torch.Tensor] = {}
        self.latent_zero: dict[int, torch.Tensor] = {}
        self.pointers: dict[int, torch.Tensor] = {}
        self.pos: dict[int, torch.Tensor] = {}
        self.centre: dict[int, torch.Tensor] = {}

    # -- layout ----------------------------------------------------------------------------------------
    def sparse_bytes(self, itemsize: int) -> int:
        """Bytes per token of one sparse layer (the centre's share rounded up)."""
        latent = self.latent_dim * itemsize
        if self.latent_bits == 4:
            latent = self.latent_dim // 2 + 2 * 2 * (self.latent_dim // LATENT_GROUP)
        return latent + (self.neighbors + 1) * INT32 + -(-self.kv_dim * itemsize // self.stride)

    def bytes_per_token(self, g: KVGeometry) -> int:
        full = 2 * g.num_kv_heads * g.head_dim * g.dtype.itemsize
        sparse = sum(1 for layer in range(g.num_layers) if layer in self.sparse_layers)
        return (g.num_layers - sparse) * full + sparse * self.sparse_bytes(g.dtype.itemsize)

    def load_model(self, model: ModelKV) -> None:
        if model.v_head_dim != model.head_dim:
            raise ValueError(f"deltakv: K and V head dims differ ({model.head_dim}, {model.v_head_dim})")
        kv_dim = 2 * model.num_kv_heads * model.head_dim
        if kv_dim != self.kv_dim:
            raise ValueError(f"deltakv: the compressor reads kv {self.kv_dim} wide, this model's layers {kv_dim} "
                             f"({model.num_kv_heads} KV heads of {model.head_dim})")
        beyond = sorted(layer for layer in self.sparse_layers if layer >= len(model.layers))
        if beyond:
            raise ValueError(f"deltakv: the compressor has layers {beyond}, the model {len(model.layers)}")
        self.num_kv_heads, self.head_dim, self.rotary = model.num_kv_heads, model.head_dim, model.rotary
        comp = self._load()
        if comp.config != self.config:
            raise ValueError(f"deltakv: the compressor's weights are of {comp.config}, its config {self.config}")
        self.compressor = comp.eval().requires_grad_(False)

    def attach_rows(self, req_to_token: torch.Tensor) -> None:
        """SGLang's ``req_to_token`` (rows by ``req_pool_idx``): a write finds its request's centres there."""
        self.req_to_token = req_to_token

    def allocate(self, g: KVGeometry) -> None:
        if g.page_size != self.stride:
            raise ValueError(f"deltakv: the pool's page size is {g.page_size}, its centre stride {self.stride}")
        if g.num_kv_heads != self.num_kv_heads:
            raise ValueError(f"deltakv: the pool has {g.num_kv_heads} KV heads, the model {self.num_kv_heads} "
                             "(load_model first)")
        dev, dt = g.device, g.dtype
        self.dtype = dt
        self._model().to(dev)
        for layer in range(g.num_layers):
            if layer not in self.sparse_layers:
                self.k[layer] = torch.zeros(g.num_slots, g.num_kv_heads, g.head_dim, dtype=dt, device=dev)
                self.v[layer] = torch.zeros_like(self.k[layer])
                continue
            if self.latent_bits == 4:
                self.latent[layer] = torch.zeros(g.num_slots, self.latent_dim // 2, dtype=torch.uint8, device=dev)
                groups = (g.num_slots, self.latent_dim // LATENT_GROUP)
                self.latent_scale[layer] = torch.zeros(groups, dtype=torch.float16, device=dev)
                self.latent_zero[layer] = torch.zeros(groups, dtype=torch.float16, device=dev)
            else:
                self.latent[layer] = torch.zeros(g.num_slots, self.latent_dim, dtype=dt, device=dev)
            self.pointers[layer] = torch.full((g.num_slots, self.neighbors), -1, dtype=torch.int32, device=dev)
            self.pos[layer] = torch.zeros(g.num_slots, dtype=torch.int32, device=dev)
            self.centre[layer] = torch.zeros(g.num_pages, self.kv_dim, dtype=dt, device=dev)
        if self.rotary is not None:
            r = self.rotary
            self.rotary = RotaryTable(r.cos_sin.to(dev, torch.float32), r.rotary_dim, r.neox)

    def slot_tensors(self, layer_id: int) -> list[torch.Tensor]:
        if layer_id not in self.sparse_layers:
            return [self.k[layer_id], self.v[layer_id]]
        quant = [self.latent_scale[layer_id], self.latent_zero[layer_id]] if self.latent_bits == 4 else []
        return [self.latent[layer_id], *quant, self.pointers[layer_id], self.pos[layer_id]]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"latent_dim": self.latent_dim, "latent_bits": self.latent_bits, "stride": self.stride,
                               "neighbors": self.neighbors, "sparse_layers": sorted(self.sparse_layers)}
        return {**out, **self.describe_prefix_attention()}

    # -- encode / decode ---------------------------------------------------------------------------------
    def _model(self) -> Compressor:
        if self.compressor is None:
            raise RuntimeError("deltakv: the compressor is loaded with the model (load_model first)")
        return self.compressor

    def _rope(self, k: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
        r = self.rotary
        if r is None:
            return k.float()
        return rotate(k, r.cos_sin[positions.long()], r.rotary_dim, r.neox, inverse=inverse)

    def _kv(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``k``, ``v`` ``[n, Hkv, D]`` -> pre-RoPE ``kv`` ``[n, kv_dim]`` in the model dtype (as a centre
        stores it, so a token's distance to a centre compares what both are read back from)."""
        n = k.shape[0]
        return torch.cat([self._rope(k, positions, inverse=True).reshape(n, -1), v.float().reshape(n, -1)],
                         dim=1).to(self.dtype)

    def _quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Latents ``[n, latent_dim]`` -> 4-bit codes packed ``[n, latent_dim / 2]`` and fp16 scale and zero
        ``[n, latent_dim / 32]``: each group's min to max in 15 steps, the codes against the fp16 scale and zero
        they are read back with."""
        n = z.shape[0]
        codes, scale, zero = asym_quantize(z.float().reshape(n, -1, LATENT_GROUP), 4, dim=2, stored=torch.float16)
        return pack_chunks(codes.reshape(n, -1), 4), scale[..., 0], zero[..., 0]

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        groups = unpack_chunks(codes, 4).reshape(n, -1, LATENT_GROUP)
        return asym_dequantize(groups, scale[..., None], zero[..., None], torch.float32).reshape(n, -1)

    def _store_latent(self, layer_id: int, loc: torch.Tensor, z: torch.Tensor) -> None:
        if self.latent_bits == 4:
            codes, scale, zero = self._quantize(z)
            self.latent[layer_id][loc], self.latent_scale[layer_id][loc] = codes, scale
            self.latent_zero[layer_id][loc] = zero
        else:
            self.latent[layer_id][loc] = z.to(self.dtype)

    def _load_latent(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """The latents at ``slots`` as stored, in fp32."""
        if self.latent_bits == 4:
            return self._dequantize(self.latent[layer_id][slots], self.latent_scale[layer_id][slots],
                                    self.latent_zero[layer_id][slots])
        return self.latent[layer_id][slots].float()

    def _as_stored(self, z: torch.Tensor) -> torch.Tensor:
        """Latents ``[n, latent_dim]`` rounded as the pool keeps them, in fp32."""
        if self.latent_bits == 4:
            return self._dequantize(*self._quantize(z))
        return z.to(self.dtype).float()

    def _split(self, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv`` ``[n, kv_dim]`` -> K (rotated at ``positions``) and V ``[n, Hkv, D]`` in the model dtype."""
        n, half = kv.shape[0], self.kv_dim // 2
        k = kv[:, :half].reshape(n, self.num_kv_heads, self.head_dim)
        v = kv[:, half:].reshape(n, self.num_kv_heads, self.head_dim)
        return self._rope(k, positions, inverse=False).to(self.dtype), v.to(self.dtype)

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              decode: bool, positions: torch.Tensor | None = None) -> None:
        if layer_id not in self.sparse_layers:
            self.k[layer_id][loc] = k.to(self.dtype)
            self.v[layer_id][loc] = v.to(self.dtype)
            return
        if positions is None or self.req_to_token is None:
            raise ValueError("deltakv: a sparse layer's write needs each token's position and req_to_token "
                             "(attach_rows)")
        loc, positions = loc.long(), positions.long()
        kv = self._kv(k, v, positions)
        self.pos[layer_id][loc] = positions.to(torch.int32)
        centre = positions % self.stride == 0
        # Centres first: a token of this write may point at its own page's centre, written in the same step.
        self.centre[layer_id][loc[centre] // self.stride] = kv[centre]
        self.pointers[layer_id][loc[centre]] = -1
        rest = (~centre).nonzero().flatten()
        for row in torch.unique(rows[rest]).tolist():
            mine = rest[rows[rest] == row]
            self._encode_row(layer_id, int(row), loc[mine], kv[mine], positions[mine])

    def _encode_row(self, layer_id: int, row: int, loc: torch.Tensor, kv: torch.Tensor,
                    positions: torch.Tensor) -> None:
        """Non-centre tokens of one request: their nearest earlier centres of the row, and the residual latents."""
        assert self.req_to_token is not None
        last = int(positions.max())
        centre_pos = torch.arange(0, last + 1, self.stride, device=positions.device)
        centre_slots = self.req_to_token[row, centre_pos].long()
        live = centre_slots != SENTINEL_SLOT
        centre_pos, centre_slots = centre_pos[live], centre_slots[live]
        centre_kv = self.centre[layer_id][centre_slots // self.stride]
        idx = nearest_centres(kv, positions, centre_kv, centre_pos, self.neighbors)
        mean = centre_mean(centre_kv, idx)
        self._store_latent(layer_id, loc, self._model().encode(layer_id, kv.float(), mean))
        self.pointers[layer_id][loc] = torch.where(idx >= 0, centre_slots[idx.clamp(min=0)], -1).to(torch.int32)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_id not in self.sparse_layers:
            return self.k[layer_id][slots], self.v[layer_id][slots]
        slots = slots.long()
        ptr = self.pointers[layer_id][slots].long()  # [n, neighbors] centre slots
        mean = centre_mean(self.centre[layer_id], torch.where(ptr >= 0, ptr // self.stride, -1))
        kv = self._model().decode(layer_id, self._load_latent(layer_id, slots), mean)
        centre = slots % self.stride == 0
        kv[centre] = self.centre[layer_id][slots[centre] // self.stride].float()
        return self._split(kv, self.pos[layer_id][slots])

    def decode(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention. With ``keep_tokens``, the original's selection (OmniKV's): each full layer reads every
        token and scores them with this step's queries (the largest ``q . k`` over the query heads), and the sparse
        layers after it, up to the next full one, read only its ``keep_tokens`` best beside the first
        ``sink_tokens`` and last ``recent_tokens`` positions, reconstructed. Sparse layers before the first full
        layer read every token; so does a row no longer than the selection."""
        if not self.keep_tokens:
            return super().decode(layer_id, q, req_to_token, req_pool_indices, seq_lens, scale)
        if layer_id not in self.sparse_layers:
            # scored up to the longest row, not the table's width (every score is a [bs, width, Hkv, D] gather)
            width = max(1, int(seq_lens.max())) if seq_lens.numel() else 1
            scores = torch.empty(q.shape[0], width, dtype=torch.float32, device=q.device)
            score_tokens_torch(q, self.k[layer_id], req_to_token, req_pool_indices, seq_lens, scores,
                               self.sink_tokens, self.recent_tokens)
            self._selected = select_pages(scores, self.sink_tokens + self.keep_tokens + self.recent_tokens)
            self._selected_rows = req_pool_indices.clone()
            return super().decode(layer_id, q, req_to_token, req_pool_indices, seq_lens, scale)
        if self._selected is None or not any(layer < layer_id for layer in self.full_layers):
            return super().decode(layer_id, q, req_to_token, req_pool_indices, seq_lens, scale)
        if not torch.equal(self._selected_rows, req_pool_indices):
            raise RuntimeError("deltakv: a sparse layer's decode batch is not the one its full layer chose for "
                               "(batches interleaved by layer are not supported)")
        out = torch.zeros_like(q)
        rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
        for i, (r, n) in enumerate(zip(rows, lens, strict=True)):
            if n > 0:
                at = self._selected[i]
                k, v = self.read(layer_id, req_to_token[r, at[at < n]].long())
                out[i] = attend(q[i:i + 1], k, v, scale)[0][0]
        return out

    @property
    def full_layers(self) -> list[int]:
        """The layers that keep every token raw (the compressor has no ``down``/``up`` for them)."""
        return [layer for layer in self.k if layer not in self.sparse_layers]

    def round_trip(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole sequence from position 0 (``positions`` ``0..n-1``) as the layout reads it back: a token's
        centres are earlier tokens of the same sequence, which this call sees (the server reads an extend's new
        tokens back from the pool instead, where the prefix's centres are)."""
        if layer_id not in self.sparse_layers:
            return k.to(self.dtype), v.to(self.dtype)
        n = k.shape[0]
        positions = torch.arange(n, device=k.device) if positions is None else positions.long()
        if not torch.equal(positions, torch.arange(n, device=k.device)):
            raise ValueError("deltakv: round_trip reads a whole sequence from position 0")
        kv = self._kv(k, v, positions)
        centre = positions % self.stride == 0
        idx = nearest_centres(kv, positions, kv[centre], positions[centre], self.neighbors)
        mean = centre_mean(kv[centre], idx)
        z = self._as_stored(self._model().encode(layer_id, kv.float(), mean))
        out = self._model().decode(layer_id, z, mean)
        out[centre] = kv[centre].float()
        return self._split(out.to(self.dtype), positions)
