"""KIVI (Liu et al., 2024, arXiv:2402.02750): asymmetric 2/4-bit KV, keys per channel, values per token.

Keys have outlier *channels*, so KIVI quantizes them per channel over a group of ``group_size``
consecutive tokens; values per token over groups of ``group_size`` channels. A group of keys can only
be quantized once all its tokens exist, so the most recent tokens stay in full precision (KIVI's
residual) until their group fills. Defaults per jy-yuan/KIVI's example: 4 bits (2 also), group 32,
residual 32 (one group).

Layout, per layer (``--page-size group_size``, set by the launcher, so a key group is one physical
page: groups never straddle two owners and pages shared through the radix tree are whole, quantized
groups):

* K and V codes ``[slots, Hkv, D * bits / 8]`` uint8, chunk-major (``kernels/quant.py::pack_chunks``: byte ``j``
  holds channel ``c * W + j`` in its ``c``-th ``bits``-wide lane, ``W = D * bits / 8``);
* K scale and zero per page and channel ``[pages, Hkv, D]``, V scale and zero per token and channel
  group ``[slots, Hkv, D / group_size]``, fp16 as in KIVI;
* the residual: each running request's open page in the model dtype, ``[max requests, group_size,
  Hkv, D]`` for K and V, indexed by ``req_pool_idx``. A position is in the residual exactly when it
  lies past its row's last whole page (radix hits are page-aligned, so a hit starts with an empty
  residual); when a write fills the page, the page is quantized from the residual.

At 4 bits a Llama-3-8B layer costs 1,280 bytes per token (codes 1,024, scales 256) against bf16's 4,096:
3.2x the tokens (2 bits: 768, 5.3x), plus the fixed residual (``--max-running-requests`` x 2 x 32 x 8 x
128 x 2 bytes a layer). The torch path here serves the CPU server and is the kernels' reference; on CUDA
decode and extend are Triton kernels (``kernels/kivi_attention.py``), checked by tests/gpu/test_gpu_kivi.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sgl_sparse.contract import Family, KVGeometry, KVStore, SparseMethod
from sgl_sparse.kernels import fp8_attention, kivi_attention, kivi_write, quant
from sgl_sparse.methods.quantization.base import QuantConfig
from sgl_sparse.registry import register_method
from sgl_sparse.store_reads import attend


@dataclass(frozen=True)
class KIVIConfig(QuantConfig):
    """``bits`` per key and value code; ``group_size`` tokens per key group (the pool's page size) and
    channels per value group; the open group is the full-precision residual. ``prefix_attention`` as
    :class:`QuantConfig`'s: either way the cached prefix is first dequantized into the workspace (whole pages and
    each row's residual), then read by the attention base's dense prefill (``dequantize``) or our Triton kernel."""

    method_name = "kivi"
    bits: int = 4
    group_size: int = 32

    def validate(self) -> None:
        self.require(self.bits in (2, 4), "bits", "must be 2 or 4")
        super().validate()
        self.require(self.group_size in (8, 16, 32, 64, 128), "group_size", "must be a power of two from 8 to 128")


class KIVIStore(KVStore):
    # Decode and extend run as Triton kernels on CUDA (kernels/kivi_attention.py).
    gpu_kernels = True
    slot_move_problem = ("a KIVI key belongs to its page's per-channel scale and zero and an open page to its "
                         "request's residual row: a single slot cannot be moved")

    def __init__(self, config: KIVIConfig) -> None:
        self.bits = config.bits
        self.page_size = self.group = config.group_size
        self.choose_prefix_attention(config.prefix_attention)
        self.dtype = torch.bfloat16
        self.use_triton = False
        self._blocks = fp8_attention.StepBlocks()

    # -- sizing ------------------------------------------------------------------------------------
    def bytes_per_token(self, g: KVGeometry) -> int:
        self._check(g)
        codes = 2 * g.num_kv_heads * g.head_dim * self.bits // 8
        key_groups = -(-2 * g.num_kv_heads * g.head_dim * 2 // self.group)  # fp16 scale + zero per page
        value_groups = 2 * g.num_kv_heads * (g.head_dim // self.group) * 2
        return g.num_layers * (codes + key_groups + value_groups)

    def fixed_bytes(self, g: KVGeometry) -> int:
        elem = torch.empty(0, dtype=g.dtype).element_size()
        return g.num_layers * 2 * g.max_requests * self.group * g.num_kv_heads * g.head_dim * elem

    def _check(self, g: KVGeometry) -> None:
        if g.head_dim % self.group or g.head_dim % 8:
            raise ValueError(f"kivi: head_dim {g.head_dim} is not a multiple of group_size {self.group}")
        if g.page_size not in (0, self.group) and g.num_slots:
            raise ValueError(f"kivi: the pool's page size {g.page_size} must be group_size {self.group}")

    def allocate(self, g: KVGeometry) -> None:
        self._check(g)
        if g.max_requests < 1:
            raise ValueError("kivi: the residual needs the number of request rows (KVGeometry.max_requests)")
        dev, h, d, gs = g.device, g.num_kv_heads, g.head_dim, self.group
        pages = -(-g.num_slots // gs)
        codes = (g.num_slots, h, d * self.bits // 8)
        self.k_codes = [torch.zeros(codes, dtype=torch.uint8, device=dev) for _ in range(g.num_layers)]
        self.v_codes = [torch.zeros(codes, dtype=torch.uint8, device=dev) for _ in range(g.num_layers)]
        self.k_scale = [torch.zeros(pages, h, d, dtype=torch.float16, device=dev) for _ in range(g.num_layers)]
        self.k_zero = [torch.zeros(pages, h, d, dtype=torch.float16, device=dev) for _ in range(g.num_layers)]
        vg = (g.num_slots, h, d // gs)
        self.v_scale = [torch.zeros(vg, dtype=torch.float16, device=dev) for _ in range(g.num_layers)]
        self.v_zero = [torch.zeros(vg, dtype=torch.float16, device=dev) for _ in range(g.num_layers)]
        res = (g.max_requests, gs, h, d)
        self.res_k = [torch.zeros(res, dtype=g.dtype, device=dev) for _ in range(g.num_layers)]
        self.res_v = [torch.zeros(res, dtype=g.dtype, device=dev) for _ in range(g.num_layers)]
        self.dtype = g.dtype
        self.use_triton = dev.type == "cuda"

    def slot_tensors(self, layer_id: int) -> list[torch.Tensor]:
        return [self.k_codes[layer_id], self.v_codes[layer_id], self.v_scale[layer_id], self.v_zero[layer_id]]

    def eviction_problem(self) -> str | None:
        return (f"KIVI quantizes keys per channel over each {self.group}-token page (one scale and zero per page) "
                f"and is served with --page-size {self.group}, whose allocator frees whole pages, while eviction "
                "drops single tokens: a page whose tokens are partly kept can be neither freed (its kept keys need "
                "the page's scales) nor compacted (moving kept keys into another page re-quantizes them under new "
                "scales, a second rounding after the method scored them); and each request's open page is a "
                "residual read by logical position, which eviction's compacted rows do not keep. Compose the "
                "eviction method with a per-token store (fp8_kv, turboquant)")

    def describe(self) -> dict[str, Any]:
        return {"format": "kivi", "bits": self.bits, "group_size": self.group,
                "scales": "keys per page and channel, values per token and channel group, fp16",
                "residual": "each running request's open page, model dtype",
                **self.describe_prefix_attention()}

    # -- write -------------------------------------------------------------------------------------
    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              decode: bool, positions: torch.Tensor | None = None) -> None:
        gs = self.group
        if decode and self.use_triton:  # one kernel: the token, and the page it fills (kernels/kivi_write.py)
            kivi_write.decode_write(self._buffers(layer_id), loc, k, v, rows, self.bits, gs)
            return
        off = loc % gs
        page = loc // gs
        rows = rows.long()
        if decode:  # one token per row: the rows' residuals are distinct (no host sync: CUDA graphs)
            self.res_k[layer_id][rows, off] = k.to(self.dtype)
            self.res_v[layer_id][rows, off] = v.to(self.dtype)
            full = off == gs - 1
            # Quantize every row's residual; store it only for rows whose page this token filled (the others
            # write page 0, SGLang's padding page, which no request reads).
            target = torch.where(full, page, torch.zeros_like(page))
            self._store_pages(layer_id, target, self.res_k[layer_id][rows], self.res_v[layer_id][rows])
            return
        # Extend: the chunk's tokens grouped by page; a page begun by an earlier chunk starts from its row's
        # residual (its first offsets), a page the chunk fills is quantized, the others go back to the residual.
        # A page's tokens all map to one entry: reduce them (amax) rather than scatter_, whose winner among
        # duplicate indices is unspecified on CUDA (a page would count as open unless its last offset wrote last).
        pages, inv = torch.unique(page, return_inverse=True)
        first_row = torch.zeros_like(pages).scatter_reduce_(0, inv, rows, reduce="amax", include_self=False)
        buf_k = self.res_k[layer_id][first_row].clone()
        buf_v = self.res_v[layer_id][first_row].clone()
        buf_k[inv, off] = k.to(self.dtype)
        buf_v[inv, off] = v.to(self.dtype)
        last = (off == gs - 1).to(torch.int32)
        filled = torch.zeros_like(pages, dtype=torch.int32).scatter_reduce_(0, inv, last, reduce="amax").bool()
        if bool(filled.any()):
            self._store_pages(layer_id, pages[filled], buf_k[filled], buf_v[filled])
        open_ = ~filled
        self.res_k[layer_id][first_row[open_]] = buf_k[open_]
        self.res_v[layer_id][first_row[open_]] = buf_v[open_]

    def _store_pages(self, layer_id: int, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole pages ``k``/``v`` ``[p, G, Hkv, D]`` into pages ``pages`` ``[p]``."""
        p, gs, h, d = k.shape
        kc, ks, kz = quant.kivi_keys(k.reshape(p * gs, h, d), self.bits, gs)
        vc, vs, vz = quant.kivi_values(v.reshape(p * gs, h, d), self.bits, gs)
        slots = (pages[:, None] * gs + torch.arange(gs, device=pages.device)).reshape(-1)
        self.k_codes[layer_id][slots] = quant.pack_chunks(kc, self.bits)
        self.v_codes[layer_id][slots] = quant.pack_chunks(vc, self.bits)
        self.k_scale[layer_id][pages] = ks.to(torch.float16)
        self.k_zero[layer_id][pages] = kz.to(torch.float16)
        self.v_scale[layer_id][slots] = vs.to(torch.float16)
        self.v_zero[layer_id][slots] = vz.to(torch.float16)

    # -- read --------------------------------------------------------------------------------------
    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K/V of slots in whole (quantized) pages; the open page's tokens are in the residual."""
        pg = slots // self.group
        return self._dequantize(quant.unpack_chunks(self.k_codes[layer_id][slots], self.bits),
                                self.k_scale[layer_id][pg], self.k_zero[layer_id][pg],
                                quant.unpack_chunks(self.v_codes[layer_id][slots], self.bits),
                                self.v_scale[layer_id][slots], self.v_zero[layer_id][slots])

    def _dequantize(self, kc: torch.Tensor, ks: torch.Tensor, kz: torch.Tensor, vc: torch.Tensor, vs: torch.Tensor,
                    vz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes ``[n, Hkv, D]``, the keys' fp16 scale and zero per token's page ``[n, Hkv, D]``, the values' per
        token and channel group ``[n, Hkv, D / G]`` -> K, V in the model dtype (what :meth:`read` and
        :meth:`round_trip` share, so that a round trip is the stored value bit for bit)."""
        k = kc.float() * ks.float() + kz.float()
        vs = vs.float().repeat_interleave(self.group, dim=-1)
        vz = vz.float().repeat_interleave(self.group, dim=-1)
        return k.to(self.dtype), (vc.float() * vs + vz).to(self.dtype)

    def round_trip(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages ``[n, Hkv, D]`` (``n`` a multiple of ``group_size``) quantized as :meth:`write` stores a page
        it fills (fp16 scales included), then read back."""
        gs = self.group
        kc, ks, kz = quant.kivi_keys(k.to(self.dtype), self.bits, gs)
        vc, vs, vz = quant.kivi_values(v.to(self.dtype), self.bits, gs)
        return self._dequantize(kc, ks.to(torch.float16).repeat_interleave(gs, dim=0),
                                kz.to(torch.float16).repeat_interleave(gs, dim=0), vc, vs.to(torch.float16),
                                vz.to(torch.float16))

    def read_open(self, layer_id: int, rows: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, offsets = rows.long(), offsets.long()
        return self.res_k[layer_id][rows, offsets], self.res_v[layer_id][rows, offsets]

    def _row(self, layer_id: int, req_to_token: torch.Tensor, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's first ``n`` positions: whole pages from the codes, the rest from its residual."""
        whole = n // self.group * self.group
        k, v = self.read(layer_id, req_to_token[row, :whole].long())
        rk, rv = self.res_k[layer_id][row, : n - whole], self.res_v[layer_id][row, : n - whole]
        return torch.cat([k, rk]), torch.cat([v, rv])

    def row_attention(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, row: int, n: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return attend(q, *self._row(layer_id, req_to_token, row, n), scale)

    def _buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor, torch.Tensor]:
        """K and V codes, K scale and zero, V scale and zero, K and V residuals: the kernels' pool arguments."""
        return (self.k_codes[layer_id], self.v_codes[layer_id], self.k_scale[layer_id], self.k_zero[layer_id],
                self.v_scale[layer_id], self.v_zero[layer_id], self.res_k[layer_id], self.res_v[layer_id])

    def decode(self, layer_id: int, q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.use_triton:
            return super().decode(layer_id, q, req_to_token, req_pool_indices, seq_lens, scale)
        return kivi_attention.decode_attention(q, *self._buffers(layer_id), req_to_token, req_pool_indices,
                                               seq_lens, scale, self.bits, self.group)

    def read_prefix(self, layer_id: int, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    prefix_lens: torch.Tensor, lens: list[int],
                    slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages from the codes, each row's open page from its residual (``read`` covers whole pages only)."""
        if not self.use_triton:
            parts = [self._row(layer_id, req_to_token, int(r), n) for r, n in zip(req_pool_indices.tolist(), lens,
                                                                                   strict=True)]
            return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])
        return kivi_attention.dequantize_prefixes(self._buffers(layer_id), req_to_token, req_pool_indices,
                                                  prefix_lens, lens, self.bits, self.group, self.dtype)

    def prefix(self, layer_id: int, q: torch.Tensor, qo_indptr: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: list[int],
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.use_triton:
            return super().prefix(layer_id, q, qo_indptr, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                                  scale)
        bm = fp8_attention.prefix_block_m(q.shape[1] // self.k_codes[layer_id].shape[1], q.is_cuda)
        return kivi_attention.prefix_attention(q, *self._buffers(layer_id), qo_indptr, req_to_token, req_pool_indices,
                                               prefix_lens, scale, self.bits, self.group, extend_lens, bm,
                                               blocks=self._blocks.get(extend_lens, bm, q.device))


@register_method
class KIVI(SparseMethod[KIVIConfig]):
    """Every token kept and read; stored in 2 or 4 bits (keys per channel, values per token)."""

    name = "kivi"
    family = Family.QUANTIZATION
    config_cls = KIVIConfig

    def __init__(self, config: KIVIConfig) -> None:
        super().__init__(config)
        self._store = KIVIStore(config)

    @property
    def store(self) -> KIVIStore:
        return self._store
