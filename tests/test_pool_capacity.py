"""benchmarks/pool_capacity.py: the pool sizes its table prints are the layouts' own sizing against a budget, and
FP8's equals what SGLang's planner gave the served FP8 run on the H200 (1,529,413 slots: 2 more, its rounding)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_table_sizes_each_layout_from_its_bytes_per_token(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import pool_capacity

    monkeypatch.setattr(sys, "argv", ["pool_capacity.py"])
    pool_capacity.main()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows["fp8_kv"][3] == "1,529,411" and rows["fp8_kv"][5].rstrip(" |") == "11"
    assert rows["vanilla bf16"][5].rstrip(" |") == "6"
    assert rows["kivi {'bits': 4}"][5].rstrip(" |") == "19"  # the 130K steps' default batches
    assert rows["turboquant {'bits': 4}"][5].rstrip(" |") == "22"
