"""Launcher -> scheduler hand-off of the method config.

SGLang spawns its scheduler processes (``mp.set_start_method("spawn")``), so module state of the
launcher is lost, but the environment is inherited. The launcher validates the config and stores
it, normalised, in one environment variable; each scheduler process reads it back when it builds
our tree and attention backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# Not "SGL_*": SGLang 0.5.17 treats that prefix as a deprecated alias of "SGLANG_*" and warns.
ENV_VAR = "SGLSPARSE_CONFIG"


@dataclass(frozen=True)
class Handoff:
    method: str
    config: dict[str, Any]
    device: str | None  # the server's --device, None when unknown (plain `sglang serve`)

    def dump(self) -> str:
        return json.dumps({"method": self.method, "config": self.config, "device": self.device})


def publish(handoff: Handoff) -> None:
    os.environ[ENV_VAR] = handoff.dump()


def read() -> Handoff:
    """The launcher's choice; ``dense`` with defaults if the server was started without our launcher
    (e.g. ``sglang serve --radix-cache-backend sgl_sparse``)."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return Handoff(method="dense", config={}, device=None)
    data = json.loads(raw)
    return Handoff(method=data["method"], config=data.get("config") or {}, device=data.get("device"))
