"""``python -m sgl_sparse.launch_server`` argument handling (no server started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sgl_sparse.integration import BACKEND_NAME, handoff
from sgl_sparse.integration.launch import parse_args
from sgl_sparse.integration.plugin import register


@pytest.fixture(autouse=True)
def _plugin_registered() -> None:
    register()  # what load_plugins() does in the real launcher; idempotent


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sgl_sparse.launch_server", *args],
                          capture_output=True, text=True, timeout=180)


def test_unknown_method_fails_naming_registered_methods() -> None:
    r = _launch("--model-path", "unused", "--sparse-method", "nope")
    assert r.returncode == 2, r.stderr
    assert "unknown sparse method 'nope'; registered methods: dense" in r.stderr


def test_help_shows_our_group() -> None:
    r = _launch("--help")
    assert r.returncode == 0
    assert "sgl_sparse:" in r.stdout and "--sparse-method NAME" in r.stdout and "--sparse-config" in r.stdout
    assert "--model-path" in r.stdout  # every SGLang flag is still there


def test_bad_config_field_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "m", "--sparse-config", '{"budget": 8}'])
    assert e.value.code == 2
    assert "dense: unknown config field(s) ['budget']" in capsys.readouterr().err


def test_bad_config_json_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--sparse-config", "{oops"])
    assert "--sparse-config: invalid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--attention-backend", "triton"], ["--radix-cache-backend", "other"],
                                   ["--page-size", "16"]])
def test_conflicting_flags_are_rejected(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", *flags])
    assert flags[0] in capsys.readouterr().err


def test_selects_our_backends_and_hands_off_config(tmp_path) -> None:
    cfg = tmp_path / "dense.json"
    cfg.write_text("{}")
    args, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-config", str(cfg)])
    assert args.attention_backend == BACKEND_NAME and args.radix_cache_backend == BACKEND_NAME
    assert args.disable_cuda_graph is True  # required for a non-torch_native name on CPU
    assert hand == handoff.Handoff("dense", {}, "cpu")
    assert json.loads(hand.dump()) == {"method": "dense", "config": {}, "device": "cpu"}


def test_explicit_own_backend_is_accepted() -> None:
    args, _ = parse_args(["--model-path", "m", "--device", "cpu", "--attention-backend", BACKEND_NAME])
    assert args.attention_backend == BACKEND_NAME


@pytest.mark.parametrize(("flags", "message"), [
    (["--enable-hierarchical-cache"], "HiCache is not supported"),
    (["--sparse-method", "snapkv", "--speculative-algorithm", "EAGLE"], "speculative decoding is not supported"),
    (["--sparse-method", "streamingllm", "--tp-size", "2"], "eviction needs one token set across TP ranks"),
    (["--sparse-method", "snapkv", "--sparse-config", '{"decode_interval": 64}', "--device", "cuda"],
     "add --disable-cuda-graph"),
])
def test_unsupported_combinations_fail_at_launch(flags: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "m", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_method_config_at_launch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--sparse-method", "snapkv", "--sparse-config", '{"budget": -1}'])
    assert "snapkv: field 'budget' must be >= 1 (got -1)" in capsys.readouterr().err


def test_eviction_method_hands_off_its_config() -> None:
    _, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "snapkv",
                          "--sparse-config", '{"budget": 512, "pooling": "maxpool"}'])
    assert hand.method == "snapkv" and hand.config["budget"] == 512 and hand.config["pooling"] == "maxpool"
    assert hand.config["window_size"] == 32  # defaults filled in


def test_benchmark_gpu_flags_are_accepted_by_our_launcher() -> None:
    """The GPU flags benchmarks/quality_suite.py sends to our launcher parse (a stock
    `--attention-backend triton` there would be an argparse error, found only on the GPU)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quality_suite.py"
    spec = importlib.util.spec_from_file_location("quality_suite", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args, hand = parse_args(["--model-path", "m", "--device", "cuda", *module.GPU_FLAGS,
                             "--sparse-method", "snapkv", "--sparse-config", '{"budget": 512}'])
    assert args.attention_backend == BACKEND_NAME and hand.method == "snapkv" and hand.device == "cuda"
