"""How the server reads a :class:`~sgl_sparse.contract.KVStore`, beside what a store author implements: the
prefix-read policy (an extend reads its cached prefix dequantized through the base's dense prefill, or through
the store's own kernel), reading a long prefix in pieces, and the plain-torch attention the store's reference
reads are made of. Serving policy, not contract: a store inherits :class:`PrefixReadPolicy` and its methods are
what the launcher, the attention backend and ``/server_info`` call. Imports only torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sgl_sparse.errors import SparseConfigError

READ_PIECE = 16_384  # slots a default KVStore.read_prefix reads at a time


class PrefixReadPolicy:
    """Which read serves an extend's cached prefix: ``dequantize_prefix`` true reads it as the store's dequantized
    K/V through the base's dense prefill (a prefill is compute-bound: each prefix token is read once per layer for
    thousands of queries, so materializing the batch's prefix for one layer costs little beside it), false through
    the store's ``prefix`` kernel. ``prefix_attention``: the configured choice, ``"auto"`` (dequantize where that
    read is served, else the kernel), ``"dequantize"`` (refused where it is not served) or ``"kernel"``;
    ``prefix_attention_fallback``: why an ``"auto"`` store reads through the kernel, if it does. A layout whose
    scores add a term the dequantized K/V lack (TurboQuant's QJL) declines the dequantized read."""

    dequantize_prefix: bool = False
    prefix_attention: str = "kernel"
    prefix_attention_fallback: str | None = None

    def choose_prefix_attention(self, mode: str) -> None:
        """Set the configured prefix read (``"auto"``, ``"dequantize"`` or ``"kernel"``)."""
        self.prefix_attention = mode
        self.dequantize_prefix = mode != "kernel"
        self.prefix_attention_fallback = None

    def decline_dequantized_prefix(self, why: str) -> None:
        """Where the dequantized prefix read is not served (``why``): an ``"auto"`` store reads through its
        ``prefix`` kernel instead and says so in :meth:`describe_prefix_attention`; an explicit ``"dequantize"``
        raises :class:`SparseConfigError` with ``why``."""
        if not self.dequantize_prefix:
            return
        if self.prefix_attention == "dequantize":
            raise SparseConfigError(f"prefix_attention 'dequantize': {why}: use 'kernel' or 'auto'")
        self.dequantize_prefix = False
        self.prefix_attention_fallback = why

    def describe_prefix_attention(self) -> dict[str, Any]:
        """The prefix read as served, for the store's ``describe``: ``prefix_attention`` (``dequantize`` or
        ``kernel``), the configured mode and, when ``auto`` fell back to the kernel, why."""
        out: dict[str, Any] = {"prefix_attention": "dequantize" if self.dequantize_prefix else "kernel",
                               "prefix_attention_config": self.prefix_attention}
        if self.prefix_attention_fallback is not None:
            out["prefix_attention_fallback"] = self.prefix_attention_fallback
        return out


def read_in_pieces(read: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], layer_id: int,
                   slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``read(layer_id, slots)``, :data:`READ_PIECE` slots at a time, into one K and one V (a read's fp32
    temporaries must not scale with a 100K-token prefix)."""
    n = slots.numel()
    if n <= READ_PIECE:
        return read(layer_id, slots)
    k0, v0 = read(layer_id, slots[:READ_PIECE])
    k, v = k0.new_empty((n, *k0.shape[1:])), v0.new_empty((n, *v0.shape[1:]))
    k[:READ_PIECE], v[:READ_PIECE] = k0, v0
    for at in range(READ_PIECE, n, READ_PIECE):
        k[at:at + READ_PIECE], v[at:at + READ_PIECE] = read(layer_id, slots[at:at + READ_PIECE])
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[n, Hq, D]`` over every row of ``k``/``v`` ``[m, Hkv, D]`` (grouped heads, no mask), in fp32:
    (output in ``q``'s dtype, log-sum-exp ``[n, Hq]``)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [m, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    lse = torch.logsumexp(logits, dim=-1)  # [Hq, n]
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(logits, dim=-1), vf)
    return out.to(q.dtype), lse.transpose(0, 1)
