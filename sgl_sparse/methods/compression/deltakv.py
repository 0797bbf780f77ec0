"""DeltaKV (arXiv 2602.08005): on its sparse layers every token's pre-RoPE K/V is stored as a latent residual
against the mean of its nearest earlier centres (every ``1 / center_ratio``-th token, kept raw), read back through
the model's trained compressor; the other layers (full) keep everything. The layout is
:class:`~sgl_sparse.methods.compression.deltakv_store.DeltaKVStore`; the compressor and its trainer
``methods/compression/deltakv_compressor.py`` and ``training/deltakv.py``.

Served on the CPU server (the store's plain-torch path): every token is kept and read back reconstructed; with
``decode_keep_tokens``, decode on a sparse layer reads only those the full layer before it chose (the original's
selection, :meth:`DeltaKVStore.decode`). Not yet: the original's raw sink and recent tokens, GPU kernels
(docs/methods/deltakv.md).

The compressor: ``compressor`` names a folder holding ``deltakv/`` (or that folder itself); empty (the default)
means the model folder's, resolved at launch (:meth:`DeltaKV.for_model`), so a missing or mismatched file is a launch
error naming it. ``random``: an untrained compressor of the model's shapes (latent 128, seed 0), for
``--load-format dummy`` speed runs only: its reconstructions are noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgl_sparse.contract import Family, SparseMethod
from sgl_sparse.errors import SparseConfigError
from sgl_sparse.methods.compression.deltakv_compressor import (
    SUBDIR,
    Compressor,
    CompressorConfig,
    auto_full_layers,
    load_compressor,
    read_compressor_config,
)
from sgl_sparse.methods.compression.deltakv_store import LATENT_BITS, DeltaKVStore
from sgl_sparse.methods.quantization.base import QuantConfig
from sgl_sparse.registry import register_method

RANDOM = "random"
RANDOM_LATENT, RANDOM_INTERMEDIATE = 128, 2048  # the original's default latent width and MLP width


@dataclass(frozen=True)
class DeltaKVConfig(QuantConfig):
    """``compressor``: a folder with ``deltakv/`` (or ``deltakv/`` itself), ``""``: the model folder's, ``random``:
    untrained (speed runs only); ``center_ratio``: the share of tokens kept raw as centres; ``neighbors``: centres a
    token's residual is taken against (both must be what the compressor was trained with); ``latent_bits``: 16 (the
    latent in the model dtype) or 4 (codes with a scale and zero point per 32 values); ``decode_keep_tokens``: the
    tokens a decode step reads on a sparse layer beside the first ``sink_tokens`` and the last ``recent_tokens``,
    chosen by the full layer before it (0, the default: every token; the original's 2,048, with 8 and 128: with
    our compressors only layer 0 is full, and its choice lost most answers on quality-small:
    docs/methods/deltakv.md)."""

    method_name = "deltakv"
    compressor: str = ""
    center_ratio: float = 0.1
    neighbors: int = 4
    latent_bits: int = 16
    decode_keep_tokens: int = 0
    sink_tokens: int = 8
    recent_tokens: int = 128

    @property
    def stride(self) -> int:
        return round(1 / self.center_ratio)

    def validate(self) -> None:
        super().validate()
        self.require(0.0 < self.center_ratio <= 0.5 and abs(1 / self.center_ratio - self.stride) < 1e-6,
                     "center_ratio", "must be 1 / N for an integer N >= 2")
        self.require(self.neighbors >= 1, "neighbors", "must be >= 1")
        self.require(self.latent_bits in LATENT_BITS, "latent_bits", f"must be one of {LATENT_BITS}")
        for name in ("decode_keep_tokens", "sink_tokens", "recent_tokens"):
            self.require(getattr(self, name) >= 0, name, "must be >= 0")


def _model_shapes(model_path: str) -> tuple[int, int]:
    """(layers, kv width ``2 * Hkv * head_dim``) from a Hugging Face ``config.json``."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SparseConfigError(f"deltakv: field 'compressor' 'random' reads the model's config.json: {e}") from None
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    return int(cfg["num_hidden_layers"]), 2 * int(cfg.get("num_key_value_heads", heads)) * head_dim


def write_random(folder: str, layers: int, kv_dim: int, stride: int, neighbors: int) -> None:
    full = auto_full_layers(layers)
    cfg = CompressorConfig(kv_dim=kv_dim, latent_dim=RANDOM_LATENT, intermediate=RANDOM_INTERMEDIATE,
                           layers=tuple(i for i in range(layers) if i not in full), stride=stride, neighbors=neighbors)
    torch.manual_seed(0)
    Compressor(cfg).save(folder)


def random_compressor(model_path: str, stride: int, neighbors: int) -> Path:
    """An untrained compressor of the model's shapes, saved once under the cache (``SGL_SPARSE_CACHE``); its folder.
    Written by a child process: the launcher forks its server's processes afterwards, and torch's thread pools
    started before a fork can hang the children."""
    from sgl_sparse.prepare import cache_dir

    layers, kv_dim = _model_shapes(model_path)
    folder = cache_dir() / f"deltakv-random-l{layers}-kv{kv_dim}-s{stride}-n{neighbors}"
    if not (folder / SUBDIR / "config.json").is_file():
        code = (f"from sgl_sparse.methods.compression.deltakv import write_random; "
                f"write_random({str(folder)!r}, {layers}, {kv_dim}, {stride}, {neighbors})")
        subprocess.run([sys.executable, "-c", code], check=True)
    return folder


@register_method
class DeltaKV(SparseMethod[DeltaKVConfig]):
    """Every token kept and read, on the sparse layers as a residual latent against its nearest earlier centres."""

    name = "deltakv"
    family = Family.COMPRESSION
    config_cls = DeltaKVConfig

    def __init__(self, config: DeltaKVConfig) -> None:
        super().__init__(config)
        self._store: DeltaKVStore | None = None
        if config.compressor and config.compressor != RANDOM:
            try:
                c = read_compressor_config(config.compressor)
            except ValueError as e:
                raise SparseConfigError(f"deltakv: field 'compressor': {e}") from None
            if (c.stride, c.neighbors) != (config.stride, config.neighbors):
                raise SparseConfigError(
                    f"deltakv: the compressor in {config.compressor} was trained with a centre every {c.stride} "
                    f"tokens and {c.neighbors} neighbours; the config asks for center_ratio {config.center_ratio} "
                    f"and neighbors {config.neighbors}")
            path = config.compressor
            try:
                self._store = DeltaKVStore(c, lambda: load_compressor(path), config.prefix_attention,
                                           config.latent_bits, config.decode_keep_tokens, config.sink_tokens,
                                           config.recent_tokens)
            except ValueError as e:
                raise SparseConfigError(f"deltakv: field 'latent_bits': {str(e).removeprefix('deltakv: ')}") from None

    def for_model(self, model_path: str) -> dict[str, Any]:
        cfg = self.config
        if cfg.compressor == RANDOM:
            return {"compressor": str(random_compressor(model_path, cfg.stride, cfg.neighbors))}
        if not cfg.compressor:
            if not (Path(model_path) / SUBDIR).is_dir():
                raise SparseConfigError(f"deltakv: field 'compressor': the model folder {model_path} has no {SUBDIR}/ "
                                        "(train one: python -m training.deltakv; or pass compressor: a folder, or "
                                        "'random' for speed runs)")
            return {"compressor": model_path}
        return {}

    @property
    def store(self) -> DeltaKVStore:
        if self._store is None:
            raise SparseConfigError("deltakv: field 'compressor' is resolved at launch (for_model) and was not")
        return self._store
