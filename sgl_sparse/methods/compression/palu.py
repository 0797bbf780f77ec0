"""Palu (arXiv 2407.21118): low-rank K and V. Each group of ``group_size`` KV heads stores a rank-``r`` latent of
its keys and values instead of the heads; attention reads them back reconstructed.

Palu factors each group's projection ``W ~= B A`` (a truncated SVD of ``W``, or of ``W C^1/2`` with ``C`` the
layer input's Gram matrix when calibrated), caches ``z = A x`` and reconstructs ``B z``. That reconstruction is
the orthogonal projection of the group's full K (or V) onto ``B``'s column space: with ``W = U S V^T``,
``B A x = U_r U_r^T W x``. So the store needs no hidden state and no model surgery: it projects the K/V the
model computed onto the top-``r`` left singular vectors ``U_r`` of the group's projection (:func:`group_bases`),
stores ``z = U_r^T k`` and reads ``U_r z`` back: exactly Palu's reconstruction. A projection bias (Qwen's) is
projected with the rest.

K is cached before the rotary embedding (a low-rank basis does not survive a position-dependent rotation): the
server hands :meth:`PaluStore.write` post-RoPE K and each token's position; the store undoes the rotation (an
orthogonal map, undone exactly up to rounding), projects, and :meth:`PaluStore.read` re-applies it at the
position it stored beside the latent. Rank ``max(16, floor(g * D * rank_ratio / 16) * 16)`` per group of
``g`` heads of dimension ``D`` (SparseEngine's rule), capped at ``g * D``.

Per token and layer the pool stores ``Hkv / g * (r_k + r_v)`` latent values in the model dtype and a 4-byte
position: at ``rank_ratio`` 0.5 on a Llama-3-8B layer (8 KV heads of 128) 2,052 bytes against bf16's 4,096.
On CPU the store writes and reads through its plain-torch path; on CUDA it writes through ``kernels/palu_write.py``
and decode runs ``kernels/palu_attention.py`` (their GPU tests: ``tests/gpu/test_gpu_palu*.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import Family, KVGeometry, KVStore, ModelKV, RotaryTable, SparseMethod
from sgl_sparse.kernels.rope import rotate
from sgl_sparse.methods.quantization.base import QuantConfig
from sgl_sparse.registry import register_method

POSITION_BYTES = 4  # int32 position per slot and layer


@dataclass(frozen=True)
class PaluConfig(QuantConfig):
    """``rank_ratio``: the latent's share of a group's ``g * D`` dimensions (0.5: SparseEngine's code's default);
    ``group_size``: KV heads per group (1: SparseEngine's; upstream Palu uses 4); ``calibration``: ``none`` (the
    plain SVD of the weights), or the text Palu's whitened SVD is calibrated on (``synthetic``: the quality suite's
    generator; or a ``.txt``/``.jsonl`` file), ``calibration_tokens`` of it; ``prefix_attention`` as the
    quantized stores' (an extend reads its cached prefix reconstructed, through the base's dense prefill, or
    through the store's own read); ``decode_tile``: the GPU decode kernel's tile,
    ``BLOCKxWARPSxSTAGES[xMAXNREG[xCHUNK[xROWS[xANGLES[xKEYROWS[xSPLITS]]]]]]`` (``kernels/palu_attention.py``'s
    ``Tile``, 0 a field's default; empty: the served tile for the rank, ``CUDA_TILES``), for tuning on a GPU other
    than the one it was chosen on."""

    method_name = "palu"
    rank_ratio: float = 0.5
    group_size: int = 1
    calibration: str = "none"
    calibration_tokens: int = 32_768
    decode_tile: str = ""

    def validate(self) -> None:
        super().validate()
        self.require(0.0 < self.rank_ratio <= 1.0, "rank_ratio", "must be in (0, 1]")
        self.require(self.group_size >= 1, "group_size", "must be >= 1")
        self.require(self.calibration in ("none", "synthetic") or os.path.isfile(self.calibration), "calibration",
                     "must be 'none' (plain SVD), 'synthetic' or a text/JSONL file of calibration prompts")
        self.require(self.calibration_tokens >= 1, "calibration_tokens", "must be >= 1")
        if self.decode_tile:
            from sgl_sparse.kernels.palu_attention import BY_ROW, parse_tile

            try:
                tile = parse_tile(self.decode_tile)
            except ValueError as e:
                self.require(False, "decode_tile", f"must be empty or BLOCKxWARPSxSTAGES[x...]: {e}")
            self.require(tile.angles != BY_ROW, "decode_tile",
                         f"angles {BY_ROW} (row index as position) is exact only for uncompacted rows: not served")


def group_rank(group_dim: int, ratio: float) -> int:
    """The latent rank of a group of ``group_dim`` dimensions (``g * D``)."""
    return min(group_dim, max(16, int(group_dim * ratio / 16) * 16))


def group_bases(weight: torch.Tensor, groups: int, rank: int) -> torch.Tensor:
    """``[groups, g * D, rank]`` fp32: the top-``rank`` left singular vectors of each group's rows of
    ``weight`` (``[groups * g * D, hidden]``), the basis Palu's reconstruction projects onto."""
    w = weight.detach().to(torch.float64).reshape(groups, -1, weight.shape[-1])
    u: torch.Tensor = torch.linalg.svd(w, full_matrices=False).U  # [groups, g*D, min(g*D, hidden)], descending
    if u.shape[-1] < rank:
        raise ValueError(f"a group's projection has rank at most {u.shape[-1]}, fewer than the latent's {rank}")
    return u[..., :rank].to(torch.float32).contiguous()


def moment_bases(moment: torch.Tensor, groups: int, rank: int) -> torch.Tensor:
    """``[groups, g * D, rank]`` fp32: the top-``rank`` eigenvectors of each group's diagonal block of ``moment``
    (``[groups * g * D, groups * g * D]``), the basis Palu's calibrated reconstruction projects onto."""
    n = moment.shape[0] // groups
    blocks = torch.stack([moment[i * n:(i + 1) * n, i * n:(i + 1) * n] for i in range(groups)]).double()
    vecs: torch.Tensor = torch.linalg.eigh((blocks + blocks.transpose(1, 2)) / 2).eigenvectors  # ascending
    return vecs.flip(-1)[..., :rank].to(torch.float32).contiguous()


class PaluStore(KVStore):
    """Per layer: K and V latents ``[slots, groups, r_k]`` / ``[slots, groups, r_v]`` in the model dtype and the
    slot's position ``[slots]`` int32; the bases ``[groups, g * D, r]`` fp32 from :meth:`load_model`."""

    needs_model = True
    gpu_kernels = True  # decode: kernels/palu_attention.py; the extend reads the prefix reconstructed (dequantize)

    def __init__(self, rank_ratio: float, group_size: int, prefix_attention: str = "auto",
                 calibration: str = "none", calibration_tokens: int = 32_768, decode_tile: str = "") -> None:
        from sgl_sparse.kernels import palu_attention

        self.choose_prefix_attention(prefix_attention)
        self.tile = palu_attention.parse_tile(decode_tile) if decode_tile else None
        self.rank_ratio, self.group_size = rank_ratio, group_size
        self.calibration, self.calibration_tokens = calibration, calibration_tokens
        self.calibrated_tokens = 0
        self.k_basis: list[torch.Tensor] = []
        self.v_basis: list[torch.Tensor] = []
        self.rotary: RotaryTable | None = None
        self.kernel_cos_sin: torch.Tensor | None = None
        self.zk: list[torch.Tensor] = []
        self.zv: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []
        self.num_kv_heads, self.head_dim, self.v_head_dim = 0, 0, 0
        self.dtype = torch.bfloat16
        self.geometry: KVGeometry | None = None

    # -- layout ----------------------------------------------------------------------------------------
    def _groups(self, num_kv_heads: int) -> int:
        if num_kv_heads % self.group_size:
            raise ValueError(f"palu: group_size {self.group_size} does not divide this rank's {num_kv_heads} KV "
                             "heads")
        return num_kv_heads // self.group_size

    def ranks(self, head_dim: int, v_head_dim: int) -> tuple[int, int]:
        """The K and V latent ranks per group."""
        g = self.group_size
        return group_rank(g * head_dim, self.rank_ratio), group_rank(g * v_head_dim, self.rank_ratio)

    def bytes_per_token(self, g: KVGeometry) -> int:
        rk, rv = self.ranks(g.head_dim, g.head_dim)
        return g.num_layers * (self._groups(g.num_kv_heads) * (rk + rv) * g.dtype.itemsize + POSITION_BYTES)

    def load_model(self, model: ModelKV) -> None:
        groups = self._groups(model.num_kv_heads)
        if model.v_head_dim != model.head_dim:
            raise ValueError(f"palu: K and V head dims differ ({model.head_dim}, {model.v_head_dim})")
        rk, rv = self.ranks(model.head_dim, model.v_head_dim)
        if self.tile is not None:
            from sgl_sparse.kernels import palu_attention

            try:
                palu_attention.check_tile(self.tile, model.head_dim)
            except ValueError as e:
                raise ValueError(f"palu: decode_tile for {model.head_dim}-dim heads: {e}") from None
        self.num_kv_heads, self.head_dim, self.v_head_dim = model.num_kv_heads, model.head_dim, model.v_head_dim
        self.rotary = model.rotary
        if self.calibration == "none":
            self.k_basis = [group_bases(layer.k_weight, groups, rk) for layer in model.layers]
            self.v_basis = [group_bases(layer.v_weight, groups, rv) for layer in model.layers]
            return
        if model.calibrate is None:
            raise ValueError("palu: calibration is not served here (tensor parallelism); use calibration 'none'")
        moments = model.calibrate(self.calibration, self.calibration_tokens)
        self.k_basis, self.v_basis = [], []
        for i, layer in enumerate(model.layers):
            mk, mv = moments.for_heads(i, layer.k_weight, layer.v_weight)
            self.k_basis.append(moment_bases(mk, groups, rk))
            self.v_basis.append(moment_bases(mv, groups, rv))
        self.calibrated_tokens = moments.tokens

    def allocate(self, g: KVGeometry) -> None:
        if len(self.k_basis) != g.num_layers or self.num_kv_heads != g.num_kv_heads:
            raise ValueError(f"palu: the pool has {g.num_layers} layers of {g.num_kv_heads} KV heads, the model's "
                             f"projections {len(self.k_basis)} of {self.num_kv_heads} (load_model first)")
        groups = self._groups(g.num_kv_heads)
        rk, rv = self.ranks(g.head_dim, g.head_dim)
        self.zk = [torch.zeros(g.num_slots, groups, rk, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
        self.zv = [torch.zeros(g.num_slots, groups, rv, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
        self.pos = [torch.zeros(g.num_slots, dtype=torch.int32, device=g.device) for _ in range(g.num_layers)]
        self.k_basis = [b.to(g.device) for b in self.k_basis]
        self.v_basis = [b.to(g.device) for b in self.v_basis]
        if self.rotary is not None:
            r = self.rotary
            self.rotary = RotaryTable(r.cos_sin.to(g.device, torch.float32), r.rotary_dim, r.neox)
            # the decode kernel's copy: fp16 halves what it gathers a position, and rounds below a bf16 key; with
            # negative positions before it where the tile turns its keys by their offset from its first row index
            # (palu_attention.BY_INDEX), which reads those
            self.kernel_cos_sin = None
            if g.device.type == "cuda":
                from sgl_sparse.kernels import palu_attention

                self.kernel_cos_sin = palu_attention.table_for(self.tile or palu_attention.cuda_tile(rk),
                                                               r.cos_sin.to(g.device, torch.float16))
        self.dtype, self.geometry = g.dtype, g

    def slot_tensors(self, layer_id: int) -> list[torch.Tensor]:
        return [self.zk[layer_id], self.zv[layer_id], self.pos[layer_id]]

    def describe(self) -> dict[str, Any]:
        factors = ("svd of the K/V projections" if self.calibration == "none" else
                   f"whitened svd, calibrated on {self.calibrated_tokens} tokens of {self.calibration}")
        out: dict[str, Any] = {"rank_ratio": self.rank_ratio, "group_size": self.group_size, "factors": factors}
        if self.geometry is not None:
            g = self.geometry
            out["k_rank"], out["v_rank"] = self.ranks(g.head_dim, g.head_dim)
            # tokens the pool holds against the model dtype's layout in the same bytes
            dense = g.num_layers * 2 * g.num_kv_heads * g.head_dim * g.dtype.itemsize
            out["capacity_vs_model_dtype"] = round(dense / self.bytes_per_token(g), 4)
        return {**out, **self.describe_prefix_attention()}

    # -- encode / decode ---------------------------------------------------------------------------------
    def _rope(self, k: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
        r = self.rotary
        if r is None:
            return k.float()
        return rotate(k, r.cos_sin[positions.long()], r.rotary_dim, r.neox, inverse=inverse)

    def _encode(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``/``v`` ``[n, Hkv, D]`` -> fp32 latents ``[n, groups, r_k]`` / ``[n, groups, r_v]``."""
        if positions is None:
            raise ValueError("palu stores pre-rotary K: its write needs each token's position")
        n, kb, vb = k.shape[0], self.k_basis[layer_id], self.v_basis[layer_id]
        pre = self._rope(k, positions, inverse=True).reshape(n, kb.shape[0], kb.shape[1])
        zk = torch.einsum("ngd,gdr->ngr", pre, kb)
        zv = torch.einsum("ngd,gdr->ngr", v.float().reshape(n, vb.shape[0], vb.shape[1]), vb)
        return zk, zv

    def _decode(self, layer_id: int, zk: torch.Tensor, zv: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents -> K (rotated at ``positions``) and V ``[n, Hkv, D]`` in the model dtype."""
        n = zk.shape[0]
        k = torch.einsum("ngr,gdr->ngd", zk.float(), self.k_basis[layer_id]).reshape(n, self.num_kv_heads, -1)
        v = torch.einsum("ngr,gdr->ngd", zv.float(), self.v_basis[layer_id]).reshape(n, self.num_kv_heads, -1)
        return self._rope(k, positions, inverse=False).to(self.dtype), v.to(self.dtype)

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              decode: bool, positions: torch.Tensor | None = None) -> None:
        r = self.rotary
        if positions is not None and k.is_cuda and r is not None and r.rotary_dim == self.head_dim:
            from sgl_sparse.kernels import palu_write

            if palu_write.fits(self.head_dim):
                # one launch instead of the torch path's 15 to 25 small kernels a layer (each decode step's, in its
                # CUDA graph)
                palu_write.write_latents(k, v, positions, loc, self.zk[layer_id], self.zv[layer_id],
                                         self.pos[layer_id], self.k_basis[layer_id], self.v_basis[layer_id],
                                         r.cos_sin, r.neox)
                return
        self._write_torch(layer_id, loc, k, v, positions)

    def _write_torch(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor | None) -> None:
        zk, zv = self._encode(layer_id, k, v, positions)
        self.zk[layer_id][loc] = zk.to(self.dtype)
        self.zv[layer_id][loc] = zv.to(self.dtype)
        assert positions is not None  # _encode raised otherwise
        self.pos[layer_id][loc] = positions.to(torch.int32)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode(layer_id, self.zk[layer_id][slots], self.zv[layer_id][slots], self.pos[layer_id][slots])

    def decode(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        r, table = self.rotary, self.kernel_cos_sin
        if q.device.type != "cuda" or r is None or table is None or r.rotary_dim != self.head_dim:
            return super().decode(layer_id, q, req_to_token, req_pool_indices, seq_lens, scale)
        from sgl_sparse.kernels import palu_attention

        return palu_attention.decode_attention(q, self.zk[layer_id], self.zv[layer_id], self.pos[layer_id],
                                               self.k_basis[layer_id], self.v_basis[layer_id], table, r.neox,
                                               req_to_token, req_pool_indices, seq_lens, scale, tile=self.tile)

    def round_trip(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        zk, zv = self._encode(layer_id, k, v, positions)
        assert positions is not None  # _encode raised otherwise
        return self._decode(layer_id, zk.to(self.dtype), zv.to(self.dtype), positions)


@register_method
class Palu(SparseMethod[PaluConfig]):
    """Every token kept and read, as low-rank latents of its K (before the rotary embedding) and V."""

    name = "palu"
    family = Family.COMPRESSION
    config_cls = PaluConfig

    def __init__(self, config: PaluConfig) -> None:
        super().__init__(config)
        self._store = PaluStore(config.rank_ratio, config.group_size, config.prefix_attention, config.calibration,
                                config.calibration_tokens, config.decode_tile)

    @property
    def store(self) -> PaluStore:
        return self._store
