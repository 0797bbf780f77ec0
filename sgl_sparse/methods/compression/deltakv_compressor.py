"""DeltaKV's compressor and its arithmetic (arXiv 2602.08005; as SparseEngine's ``utils/compressor.py`` and
``deltakv_base.py`` define them), torch only.

A token's **pre-RoPE** K and V of one layer, concatenated (``kv``, ``2 * Hkv * d`` wide), is stored on a sparse layer
as a latent *residual* against its reference tokens (**centres**): every ``stride``-th position keeps its raw ``kv``;
every other token points at its ``neighbors`` nearest earlier centres (L2 over ``kv``) and keeps
``z = down(kv) - down(c)``, ``c`` the mean of those centres' ``kv``; it is read back as ``up(z) + c``. ``down`` and
``up`` are per-layer MLPs (Linear, GELU, Linear), trained to make that round trip exact on the model's own K/V
(training/deltakv.py).

The compressor of a model lives in its folder, ``deltakv/compressor.safetensors`` (a subfolder: SGLang loads every
``*.safetensors`` beside ``config.json`` as weights), with ``deltakv/config.json`` (:class:`CompressorConfig`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

SUBDIR = "deltakv"


@dataclass(frozen=True)
class CompressorConfig:
    """The shapes of a trained compressor and the model it was trained on."""

    kv_dim: int  # 2 * Hkv * d of the model's layers
    latent_dim: int
    intermediate: int
    layers: tuple[int, ...]  # the sparse layers, each with its own down/up
    stride: int  # every stride-th position is a centre (1 / center_ratio)
    neighbors: int

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "layers": list(self.layers)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> CompressorConfig:
        data = json.loads(text)
        return cls(**{**data, "layers": tuple(data["layers"])})


def _mlp(d_in: int, d_hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out))


class Compressor(nn.Module):
    """Per sparse layer a ``down`` (kv -> latent) and an ``up`` (latent -> kv) MLP."""

    def __init__(self, config: CompressorConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.down = nn.ModuleDict({str(i): _mlp(c.kv_dim, c.intermediate, c.latent_dim) for i in c.layers})
        self.up = nn.ModuleDict({str(i): _mlp(c.latent_dim, c.intermediate, c.kv_dim) for i in c.layers})

    def encode(self, layer: int, kv: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
        """``kv``, ``centre`` ``[n, kv_dim]`` -> the residual latent ``[n, latent_dim]``."""
        down = self.down[str(layer)]
        out: torch.Tensor = down(kv) - down(centre)
        return out

    def decode(self, layer: int, z: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
        """The latent ``[n, latent_dim]`` and its centre mean ``[n, kv_dim]`` -> ``kv`` ``[n, kv_dim]``."""
        out: torch.Tensor = self.up[str(layer)](z) + centre
        return out

    def round_trip(self, layer: int, kv: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
        return self.decode(layer, self.encode(layer, kv, centre), centre)

    def save(self, model_dir: str | Path) -> Path:
        """Write ``deltakv/compressor.safetensors`` and ``deltakv/config.json`` into ``model_dir``."""
        from safetensors.torch import save_file

        out = Path(model_dir) / SUBDIR
        out.mkdir(parents=True, exist_ok=True)
        # bf16, as it serves (a model's KV is bf16): half the bytes of the assets it ships in
        save_file({k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in self.state_dict().items()},
                  str(out / "compressor.safetensors"))
        (out / "config.json").write_text(self.config.to_json() + "\n")
        return out


def _files(path: str | Path) -> tuple[Path, Path]:
    folder = Path(path)
    if (folder / SUBDIR).is_dir():
        folder = folder / SUBDIR
    cfg_file, weights = folder / "config.json", folder / "compressor.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise ValueError(f"deltakv: no compressor file {f}")
    return cfg_file, weights


def read_compressor_config(path: str | Path) -> CompressorConfig:
    """The :class:`CompressorConfig` of a saved compressor (``path`` as :func:`load_compressor`'s), without its
    weights: no torch work, so a launcher that forks its server's processes afterwards may call it."""
    cfg_file, _ = _files(path)
    try:
        return CompressorConfig.from_json(cfg_file.read_text())
    except (TypeError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"deltakv: {cfg_file} is not a compressor config: {e}") from None


def load_compressor(path: str | Path) -> Compressor:
    """A compressor saved by :meth:`Compressor.save`: ``path`` is its folder or the model folder holding it. A
    missing or inconsistent file raises ``ValueError`` naming it."""
    from safetensors.torch import load_file

    cfg_file, weights = _files(path)
    comp = Compressor(read_compressor_config(path))
    try:
        comp.load_state_dict({k: v.float() for k, v in load_file(str(weights)).items()})
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"deltakv: {weights} does not match {cfg_file}: {e}") from None
    return comp.eval()


def is_centre(positions: torch.Tensor, stride: int) -> torch.Tensor:
    """Whether each position is a centre (every ``stride``-th, from position 0)."""
    return positions % stride == 0


def nearest_centres(kv: torch.Tensor, positions: torch.Tensor, centre_kv: torch.Tensor,
                    centre_pos: torch.Tensor, neighbors: int) -> torch.Tensor:
    """For each token (``kv`` ``[n, D]`` at ``positions`` ``[n]``), the indices into ``centre_kv`` ``[m, D]`` of its
    ``neighbors`` nearest centres by L2 among those at earlier positions (``centre_pos`` ``[m]``), nearest first;
    ``-1`` where fewer exist. ``[n, neighbors]`` int64."""
    d = torch.cdist(kv.float(), centre_kv.float())  # [n, m]
    d = d.masked_fill(centre_pos[None, :] >= positions[:, None], float("inf"))
    k = min(neighbors, centre_kv.shape[0])
    dist, idx = d.topk(k, dim=1, largest=False) if k > 0 else (d[:, :0], d[:, :0].long())
    idx = idx.masked_fill(dist.isinf(), -1)
    if k < neighbors:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], neighbors - k), -1)], dim=1)
    return idx


def centre_mean(centre_kv: torch.Tensor, pointers: torch.Tensor) -> torch.Tensor:
    """The mean ``kv`` of each token's centres (``pointers`` ``[n, k]`` into ``centre_kv``, ``-1`` unused), fp32 (the
    gathered centres are upcast, so a pool in the model dtype is read as a fp32 copy of them is)."""
    valid = pointers >= 0
    gathered = centre_kv[pointers.clamp(min=0)].float() * valid[..., None]
    return gathered.sum(1) / valid.sum(1, keepdim=True).clamp(min=1)


def sequence_centres(kv: torch.Tensor, stride: int, neighbors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole sequence's ``kv`` ``[n, D]`` (positions 0..n-1): its centres' mask ``[n]`` and every token's centre
    mean ``[n, D]`` (a centre's own: itself; a token before any earlier centre: zeros)."""
    pos = torch.arange(kv.shape[0], device=kv.device)
    mask = is_centre(pos, stride)
    ptr = nearest_centres(kv, pos, kv[mask], pos[mask], neighbors)
    mean = centre_mean(kv[mask], ptr)
    mean[mask] = kv[mask]
    return mask, mean


# The original's full layers for a 32-layer model (Llama-3.1-8B; SparseEngine's LongBench setting).
ORIGINAL_FULL_LAYERS = (0, 2, 7, 13, 16, 26)


def auto_full_layers(num_layers: int) -> tuple[int, ...]:
    """The original's full layers scaled to ``num_layers``: the same share of layers (at least one), at the scaled
    positions of the original's, the earliest first (layer 0 is always one: the selection reads it)."""
    count = max(1, round(len(ORIGINAL_FULL_LAYERS) * num_layers / 32))
    scaled = sorted({min(num_layers - 1, round(layer * num_layers / 32)) for layer in ORIGINAL_FULL_LAYERS})
    return tuple(scaled[:count])
