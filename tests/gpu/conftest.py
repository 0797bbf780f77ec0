"""GPU tests (tests/gpu/README.md): real SGLang servers, ours and vanilla FlashInfer, on one CUDA GPU.

Every test in this folder is marked ``gpu``; without CUDA (``torch.cuda.is_available()`` false) the whole
folder is skipped before any fixture starts a server.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE == Path(item.path).resolve().parent]
    if not mine:
        return
    skip = None if _cuda() else pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)
