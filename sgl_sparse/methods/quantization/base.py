"""What every quantization method's config shares: how an extend's queries read the cached prefix."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_sparse.config import MethodConfig

PREFIX_ATTENTION = ("auto", "dequantize", "kernel")


@dataclass(frozen=True)
class QuantConfig(MethodConfig):
    """``prefix_attention``: how an extend's queries read the cached prefix. ``"dequantize"``: the prefix is
    dequantized to the model dtype for each layer's call (transient: 4 bytes x KV heads x head dim per prefix
    token, up to ``DEQUANTIZE_MAX_TOKENS`` a step, past which that step uses the kernel) and read by the attention
    base's dense prefill (FlashInfer's ragged prefill on the GPU): several times faster than the kernels, and
    faster than vanilla's bf16 prefill (BENCHMARKS.md). ``"kernel"``: the
    store's Triton prefix kernel over the codes. ``"auto"`` (default): ``dequantize`` where it is served, else the
    kernel (with TurboQuant's ``qjl``, on a GPU base other than FlashInfer), as ``/server_info`` reports."""

    prefix_attention: str = "auto"

    def validate(self) -> None:
        self.require(self.prefix_attention in PREFIX_ATTENTION, "prefix_attention",
                     "must be " + ", ".join(repr(m) for m in PREFIX_ATTENTION))
