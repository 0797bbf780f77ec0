"""``python -m sgl_sparse.launch_server`` argument handling (no server started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sgl_sparse.integration import BACKEND_NAME, handoff
from sgl_sparse.integration.launch import DEFAULT_RUNNING_REQUESTS, parse_args, with_boundary_ids
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
    assert "unknown sparse method 'nope'; registered methods: deltakv, dense" in r.stderr


def test_help_shows_our_group() -> None:
    r = _launch("--help")
    assert r.returncode == 0
    assert "sgl_sparse:" in r.stdout and "--sparse-method NAME" in r.stdout and "--sparse-config" in r.stdout
    assert "--model-path" in r.stdout  # every SGLang flag is still there
    # The one switch for combinations not yet run on hardware, saying what it unlocks.
    assert "--sparse-allow-unverified" in r.stdout and "--tp-size > 1 on CUDA" in " ".join(r.stdout.split())


def test_bad_config_field_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "m", "--sparse-config", '{"budget": 8}'])
    assert e.value.code == 2
    assert "dense: unknown config field(s) ['budget']" in capsys.readouterr().err


def test_bad_config_json_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--sparse-config", "{oops"])
    assert "--sparse-config: invalid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [
    ["--device", "cpu", "--attention-backend", "triton"],
    ["--device", "cpu", "--attention-backend", "flashinfer"],
    ["--device", "cpu", "--attention-backend", "intel_amx"],
    ["--device", "cuda", "--attention-backend", "torch_native"],
    ["--device", "cuda", "--attention-backend", "fa3"],
    ["--device", "cuda", "--prefill-attention-backend", "triton"],  # base is flashinfer
    ["--device", "cuda", "--attention-backend", "triton", "--decode-attention-backend", "flashinfer"],
    ["--device", "cuda", "--decode-attention-backend", "fa3"],
    ["--device", "cpu", "--prefill-attention-backend", "triton"],
    ["--radix-cache-backend", "other"],
    ["--page-size", "16"],
])
def test_conflicting_flags_are_rejected(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "m", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flags[-2]} {flags[-1]}" in err
    if "--device" in flags and "backend" in flags[-2]:  # names what the device supports
        assert ("flashinfer or triton" if flags[1] == "cuda" else "torch_native") in err


def test_unsupported_device_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--device", "xpu"])
    assert "sgl_sparse serves on cuda and cpu only" in capsys.readouterr().err


@pytest.mark.parametrize(("device", "flags", "base"), [
    ("cuda", [], "flashinfer"),
    ("cuda", ["--attention-backend", BACKEND_NAME], "flashinfer"),
    ("cuda", ["--attention-backend", "flashinfer"], "flashinfer"),
    ("cuda", ["--attention-backend", "triton"], "triton"),
    ("cuda", ["--attention-backend", "triton", "--prefill-attention-backend", "triton",
              "--decode-attention-backend", "triton"], "triton"),
    ("cuda", ["--prefill-attention-backend", "flashinfer", "--decode-attention-backend", BACKEND_NAME],
     "flashinfer"),
    ("cpu", [], "torch_native"),
    ("cpu", ["--attention-backend", "torch_native", "--decode-attention-backend", "torch_native"], "torch_native"),
])
def test_base_backend_per_device(device: str, flags: list[str], base: str) -> None:
    args, hand = parse_args(["--model-path", "m", "--device", device, *flags])
    assert hand.base == base and hand.device == device
    assert args.attention_backend == BACKEND_NAME
    # Both None, so SGLang resolves both phases to our backend (a matching pair would replace it).
    assert args.prefill_attention_backend is None and args.decode_attention_backend is None


def test_selects_our_backends_and_hands_off_config(tmp_path) -> None:
    cfg = tmp_path / "dense.json"
    cfg.write_text("{}")
    args, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-config", str(cfg)])
    assert args.attention_backend == BACKEND_NAME and args.radix_cache_backend == BACKEND_NAME
    assert args.disable_cuda_graph is True  # required for a non-torch_native name on CPU
    assert hand == handoff.Handoff("dense", {}, "cpu", base="torch_native",
                                   prefill_cuda_graph_off="no CUDA graphs on CPU",
                                   replay_prune_problem="this server serves no request prunes")
    assert json.loads(hand.dump()) == {"method": "dense", "config": {}, "device": "cpu", "base": "torch_native",
                                       "prefill_cuda_graph_off": "no CUDA graphs on CPU", "request_methods": "off",
                                       "request_decode_window": 0,
                                       "scored_prune_problem": None,
                                       "replay_prune_problem": "this server serves no request prunes",
                                       "replay_prompts": None}


@pytest.mark.parametrize(("argv", "policy"), [
    (["--sparse-method", "snapkv"], "eviction"),  # an eviction server serves the family per request by default
    (["--sparse-method", "snapkv", "--sparse-request-methods", "off"], "off"),
    ([], "off"),  # a dense server keeps SGLang's stock attention lists unless asked
    (["--sparse-request-methods", "eviction"], "eviction"),
    (["--sparse-method", "quest"], "off"),
])
def test_request_methods_policy(argv: list[str], policy: str) -> None:
    _, hand = parse_args(["--model-path", "m", "--device", "cpu", *argv])
    assert hand.request_methods == policy


def test_request_methods_on_a_dense_cuda_server_turns_the_prefill_graph_off() -> None:
    args, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-request-methods", "eviction"])
    assert args.cuda_graph_backend_prefill == "disabled"
    assert "per-request eviction methods" in hand.prefill_cuda_graph_off
    assert hand.request_methods == "eviction"
    _, dense = parse_args(["--model-path", "m", "--device", "cuda"])
    assert dense.prefill_cuda_graph_off is None and dense.request_methods == "off"


@pytest.mark.parametrize(("argv", "message"), [
    (["--sparse-method", "quest", "--sparse-request-methods", "eviction"], "selection method"),
    (["--sparse-method", "fp8_kv", "--sparse-request-methods", "eviction"], "owns the KV pool's layout"),
    (["--sparse-request-methods", "sometimes"], "invalid choice"),
])
def test_request_methods_launch_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--model-path", "m", "--device", "cpu", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("hand", [
    handoff.Handoff("snapkv", {"budget": 512}, "cuda", base="flashinfer",
                    prefill_cuda_graph_off="snapkv captures prefill queries, which a replayed prefill graph skips"),
    handoff.Handoff("dense", {}, "cuda", base="triton"),
    handoff.Handoff("dense", {}, None),
])
def test_handoff_round_trip(hand: handoff.Handoff, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(handoff.ENV_VAR, "")  # so that the test's environment is restored afterwards
    handoff.publish(hand)
    assert handoff.read() == hand


def test_handoff_without_launcher_has_no_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(handoff.ENV_VAR, raising=False)
    assert handoff.read() == handoff.Handoff("dense", {}, None, base=None, prefill_cuda_graph_off=None)
    # A hand-off written before the new fields existed still reads (base unknown).
    monkeypatch.setenv(handoff.ENV_VAR, json.dumps({"method": "dense", "config": {}, "device": "cuda"}))
    assert handoff.read().base is None and handoff.read().prefill_cuda_graph_off is None


def test_explicit_own_backend_is_accepted() -> None:
    args, _ = parse_args(["--model-path", "m", "--device", "cpu", "--attention-backend", BACKEND_NAME])
    assert args.attention_backend == BACKEND_NAME


SNAPKV_DECODE = ["--sparse-method", "snapkv", "--sparse-config", '{"decode_interval": 64}']


@pytest.mark.parametrize(("flags", "message"), [
    (["--enable-hierarchical-cache"], "HiCache is not supported"),
    *[([*m, "--speculative-algorithm", algo], "speculative decoding is not supported")
      for m in ([], ["--sparse-method", "snapkv"], ["--sparse-method", "streamingllm"])
      for algo in ("EAGLE", "NGRAM")],
    *[([*m, "--pp-size", "2"], "pipeline parallelism is not supported") for m in ([], ["--sparse-method", "snapkv"])],
    *[([*m, "--dcp-size", "2"], "decode context parallelism is not supported")
      for m in ([], ["--sparse-method", "streamingllm"])],
    *[(["--disaggregation-mode", mode], "PD disaggregation is not supported") for mode in ("prefill", "decode")],
    (["--enable-dp-attention"], "DP attention is not supported"),
    (["--enable-mis"], "multi-item scoring is not supported"),
    (["--enable-hisparse"], "hierarchical sparse attention"),
    (["--enable-pdmux"], "PD multiplexing"),
    (["--enable-two-batch-overlap"], "micro-batch overlap"),
    *[([*m, flag], "would be silently off") for m in ([], ["--sparse-method", "snapkv"], ["--sparse-method", "quest"])
      for flag in ("--enable-lmcache", "--enable-flexkv")],
    *[([*m, *flag], "batch-invariant kernels are chosen by attention backend name")
      for m in ([], ["--sparse-method", "snapkv"])
      for flag in (["--enable-deterministic-inference"], ["--rl-on-policy-target", "fsdp"])],
    *[([*m, "--enable-torch-compile"], "torch.compile would trace") for m in ([], ["--device", "cuda"])],
    (["--grpc-mode"], "the gRPC servicer replaces SGLang's HTTP server"),
    (["--attn-cp-size", "2"], "context parallelism writes prefill K/V"),
    (["--enable-prefill-cp"], "context parallelism writes prefill K/V"),
    (["--dllm-algorithm", "LowConfidence"], "diffusion LLM decoding"),
    *[(["--kv-canary", mode], "the canary walks SGLang's own radix tree") for mode in ("log", "raise")],
    *[(["--sparse-method", m, "--kv-cache-dtype", "fp8_e4m3"], msg)
      for m, msg in (("quest", "page summaries and scores are kept in the KV dtype"),
                     ("omnikv", "page summaries and scores are kept in the KV dtype"),
                     ("retroinfer", "page summaries and scores are kept in the KV dtype"),
                     ("kvzip", "replay scores read the raw FP8 keys"))],
    (["--sparse-method", "streamingllm", "--num-continuous-decode-steps", "4"], "once per scheduled batch"),
    (["--sparse-method", "snapkv", "--strip-thinking-cache"], "frees the output part of the row"),
    *[([*m, "--kv-cache-dtype", dtype], "FP4 KV is not supported")
      for m in ([], ["--sparse-method", "streamingllm"]) for dtype in ("nvfp4", "fp4_mx_block16", "fp4_e2m1")],
    (["--kv-cache-dtype", "mxfp8"], "only SGLang's fa4 backend reads MXFP8 KV"),
    *[(["--sparse-method", "snapkv", "--kv-cache-dtype", dtype], "ignore k_scale")
      for dtype in ("fp8_e4m3", "fp8_e5m2")],
    # An explicit prefill graph with a method that captures prefill queries.
    *[(["--sparse-method", "snapkv", "--device", "cuda", *f], "a replayed prefill graph has no request ids")
      for f in (["--cuda-graph-backend-prefill", "breakable"], ["--cuda-graph-backend-prefill", "tc_piecewise"],
                ["--enable-breakable-cuda-graph"], ["--cuda-graph-config", '{"prefill": {"backend": "full"}}'])],
    # Graphs cannot run on CPU.
    (["--device", "cpu", "--cuda-graph-backend-decode", "full"], "CUDA graphs cannot run on CPU"),
    (["--device", "cpu", "--cuda-graph-config", '{"prefill": {"backend": "breakable"}}'],
     "CUDA graphs cannot run on CPU"),
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


@pytest.mark.parametrize("flags", [
    ["--device", "cuda", "--disable-cuda-graph"],
    ["--device", "cuda", "--cuda-graph-backend-decode", "disabled"],
    ["--device", "cuda", "--disable-decode-cuda-graph"],
    ["--device", "cuda", "--cuda-graph-config", '{"decode": {"backend": "disabled"}}'],
    ["--device", "cpu"],  # no graphs on CPU at all
])
def test_decode_capture_accepts_any_decode_graph_off_switch(flags: list[str]) -> None:
    args, hand = parse_args(["--model-path", "m", *SNAPKV_DECODE, *flags])
    assert hand.method == "snapkv" and hand.config["decode_interval"] == 64
    args, hand = parse_args(["--model-path", "m", "--sparse-method", "rkv", *flags])
    assert hand.method == "rkv" and hand.config["evict_interval"] == 128


def test_rkv_with_decode_graphs_off_also_turns_the_prefill_graph_off() -> None:
    args, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "rkv",
                             "--cuda-graph-backend-decode", "disabled"])
    assert args.cuda_graph_backend_prefill == "disabled"
    assert hand.prefill_cuda_graph_off is not None and "rkv captures prefill queries" in hand.prefill_cuda_graph_off


@pytest.mark.parametrize(("method", "device", "flags", "prefill", "off"), [
    # SnapKV captures prefill queries: the launcher turns the prefill graph off and says why.
    ("snapkv", "cuda", [], "disabled", "snapkv captures prefill queries"),
    ("snapkv", "cuda", ["--cuda-graph-config", '{"prefill": {"max_bs": 64}}'], "disabled",
     "snapkv captures prefill queries"),
    # Already off by the user's flags: nothing to do, and nothing claimed.
    ("snapkv", "cuda", ["--disable-piecewise-cuda-graph"], "disabled", None),
    ("snapkv", "cuda", ["--cuda-graph-backend-prefill", "disabled"], "disabled", None),
    ("snapkv", "cuda", ["--disable-prefill-cuda-graph"], None, None),
    # A dense server keeps every SGLang default; an evicting one without a window turns the prefill graph off
    # (a request's own scored prune reads the prompt's last queries; an explicit one is a launch error).
    ("dense", "cuda", [], None, None),
    ("streamingllm", "cuda", [], "disabled", "a request's own prune"),
    ("streamingllm", "cuda", ["--disable-piecewise-cuda-graph"], "disabled", None),
    # An explicit prefill graph stays (its requests' scored prunes are refused: below).
    ("streamingllm", "cuda", ["--cuda-graph-backend-prefill", "breakable"], "breakable", None),
    ("dense", "cuda", ["--enable-breakable-cuda-graph"], "breakable", None),
])
def test_prefill_cuda_graph_switch(method: str, device: str, flags: list[str], prefill: str | None,
                                   off: str | None) -> None:
    from sgl_sparse.integration.launch import requested_graph_backend

    args, hand = parse_args(["--model-path", "m", "--device", device, "--sparse-method", method, *flags])
    assert args.cuda_graph_backend_prefill == prefill
    assert (hand.prefill_cuda_graph_off is None) if off is None else (off in hand.prefill_cuda_graph_off)
    if method != "snapkv":  # untouched: decode graphs and the legacy switch as SGLang would have them
        assert args.disable_cuda_graph is False and requested_graph_backend(args, "decode") is None
    if method == "snapkv":
        assert requested_graph_backend(args, "prefill") == "disabled"


@pytest.mark.parametrize(("flags", "words"), [
    (["--sparse-method", "streamingllm", "--device", "cuda"], None),
    (["--sparse-method", "snapkv", "--device", "cuda"], None),
    (["--sparse-method", "streamingllm", "--device", "cpu"], None),
    (["--sparse-method", "streamingllm", "--device", "cuda", "--cuda-graph-backend-prefill", "breakable"],
     "replays prefill CUDA graphs (backend breakable)"),
    (["--sparse-method", "streamingllm", "--device", "cuda", "--kv-cache-dtype", "fp8_e4m3"], "raw FP8 keys"),
])
def test_where_a_request_cannot_keep_a_scored_part_of_its_prune(flags: list[str], words: str | None) -> None:
    """The handoff says why a request's own prune cannot keep a scored part of its ranges on this server (its
    requests then get a 400 naming custom_params['sgl_sparse_prune']); the server itself starts."""
    from sgl_sparse.prune.spec import PruneSpec
    from sgl_sparse.registry import create_method
    from sgl_sparse.request_methods import MethodResolver, prune_problem

    _, hand = parse_args(["--model-path", "m", *flags])
    assert (hand.scored_prune_problem is None) if words is None else (words in hand.scored_prune_problem)
    assert handoff.Handoff(**{**vars(hand)}).scored_prune_problem == hand.scored_prune_problem
    resolver = MethodResolver(create_method(hand.method, hand.config), hand.request_methods,
                              hand.scored_prune_problem)
    assert prune_problem(resolver, PruneSpec(((0, 10),))) is None  # a drop needs no scores
    why = prune_problem(resolver, PruneSpec(((0, 10),), 4, "snapkv_global"))
    assert (why is None) if words is None else ("snapkv_global (keep_tokens / keep_ratio) cannot be served here"
                                                in why and words in why)


@pytest.mark.parametrize(("flags", "words"), [
    (["--sparse-method", "streamingllm", "--device", "cpu"], None),
    (["--sparse-method", "dense", "--device", "cpu", "--sparse-request-methods", "eviction"], None),
    (["--sparse-method", "streamingllm", "--device", "cuda"], None),
    (["--sparse-method", "streamingllm", "--device", "cpu", "--tp-size", "2"], None),
    (["--sparse-method", "snapkv+fp8_kv", "--device", "cpu"], "method-owned KV layout"),
    (["--sparse-method", "pyramidkv", "--device", "cpu"], "per-layer selector"),
])
def test_where_a_request_cannot_keep_by_kvzip_global(flags: list[str], words: str | None) -> None:
    """kvzip_global runs replay forwards in the request's step: where they cannot run (as for the kvzip method), a
    request asking for it is refused (400 naming custom_params['sgl_sparse_prune']) and the other policies stay."""
    from sgl_sparse.prune.spec import PruneSpec
    from sgl_sparse.registry import create_method
    from sgl_sparse.request_methods import MethodResolver, prune_problem

    _, hand = parse_args(["--model-path", "m", *flags])
    assert (hand.replay_prune_problem is None) if words is None else (words in hand.replay_prune_problem)
    resolver = MethodResolver(create_method(hand.method, hand.config), hand.request_methods,
                              hand.scored_prune_problem, hand.replay_prune_problem)
    why = prune_problem(resolver, PruneSpec(((0, 10),), 4, "kvzip_global"))
    assert (why is None) if words is None else ("kvzip_global (keep_tokens / keep_ratio) cannot be served here"
                                                in why and words in why)
    if words is not None and "FP8" not in (hand.scored_prune_problem or ""):
        assert prune_problem(resolver, PruneSpec(((0, 10),), 4, "knorm")) is None
    # The scheduler reads the same: without tokenized instructions the handoff cannot say "served".
    unset = json.loads(hand.dump())
    unset["replay_prompts"] = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(handoff.ENV_VAR, json.dumps(unset))
        got = handoff.read().replay_prune_problem
    assert (got == "the launcher did not tokenize KVzip's instructions") if words is None else words in got


def test_dense_keeps_sglang_graph_defaults_and_streamingllm_all_but_prefill() -> None:
    """Dense changes nothing graph-related; StreamingLLM only the prefill graph (a request's own scored prune)."""
    from sgl_sparse.integration.launch import build_parser

    for method in ("dense", "streamingllm"):
        argv = ["--model-path", "m", "--device", "cuda", "--sparse-method", method]
        args, _ = parse_args(argv)
        stock = build_parser().parse_args(argv)
        graph_fields = [k for k in vars(stock) if "cuda_graph" in k and not (method == "streamingllm" and k ==
                                                                             "cuda_graph_backend_prefill")]
        assert graph_fields and all(getattr(args, k) == getattr(stock, k) for k in graph_fields)
        assert all(getattr(args, k) in (None, False) for k in graph_fields if "backend" in k or "disable" in k)


@pytest.mark.parametrize("flags", [["--disable-radix-cache"], ["--enable-mixed-chunk"],
                                   ["--kv-cache-dtype", "fp8_e4m3"], ["--kv-cache-dtype", "bf16"]])
@pytest.mark.parametrize("method", ["dense", "streamingllm"])
def test_flags_that_work_with_our_backends_are_accepted(flags: list[str], method: str) -> None:
    args, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", method, *flags])
    assert hand.method == method and args.attention_backend == BACKEND_NAME


def test_server_info_reports_prefill_graph_decision() -> None:
    from types import SimpleNamespace

    from sgl_sparse.integration.server_info import prefill_cuda_graph

    ours = handoff.Handoff("snapkv", {}, "cuda", base="flashinfer", prefill_cuda_graph_off="snapkv captures prefill")
    sched = SimpleNamespace(server_args=SimpleNamespace(
        cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend="breakable"))))
    assert prefill_cuda_graph(sched, ours) == "disabled by sgl_sparse: snapkv captures prefill"
    assert prefill_cuda_graph(sched, handoff.Handoff("dense", {}, "cuda")) == "sglang: breakable"
    bare = SimpleNamespace(server_args=SimpleNamespace(cuda_graph_config=None))
    assert prefill_cuda_graph(bare, handoff.Handoff("dense", {}, None)) == "sglang default"


@pytest.mark.parametrize("flags", [
    [], ["--disable-cuda-graph"], ["--disable-piecewise-cuda-graph"], ["--enable-breakable-cuda-graph"],
    ["--enforce-piecewise-cuda-graph"], ["--disable-decode-cuda-graph"], ["--cuda-graph-backend-decode", "breakable"],
    ["--disable-cuda-graph", "--cuda-graph-backend-decode", "full"],
    ["--disable-prefill-cuda-graph", "--cuda-graph-backend-prefill", "tc_piecewise"],
    ["--cuda-graph-config", '{"decode": {"backend": "disabled"}, "prefill": {"max_bs": 4}}',
     "--cuda-graph-backend-decode", "full"],
])
def test_requested_graph_backend_matches_sglang_precedence(flags: list[str]) -> None:
    """Our reading of the graph flags equals SGLang's own resolution, wherever the flags set a backend."""
    import copy

    from sglang.srt.server_args import ServerArgs

    from sgl_sparse.integration.launch import build_parser, requested_graph_backend

    args = build_parser().parse_args(["--model-path", "m", *flags])
    resolved = copy.copy(args)
    ServerArgs._parse_cuda_graph_config(resolved)  # type: ignore[arg-type]  # reads and sets plain attributes
    for phase in ("decode", "prefill"):
        set_by_flags = (phase, "backend") in resolved._cuda_graph_config_locked
        expected = getattr(resolved.cuda_graph_config, phase).backend if set_by_flags else None
        assert requested_graph_backend(args, phase) == expected


def test_quest_is_served_with_its_page_size(capsys: pytest.CaptureFixture[str]) -> None:
    args, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "quest"])
    assert args.page_size == 16 and hand.method == "quest"
    args, _ = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "quest", "--page-size", "16",
                          "--sparse-config", '{"page_size": 16}'])
    assert args.page_size == 16
    for flags, needle in ((["--page-size", "1"], "--page-size 1: --sparse-method quest is served with page size 16"),
                          (["--sparse-config", '{"page_size": 8}', "--page-size", "16"], "page size 8"),
                          (["--sparse-config", '{"page_size": 12}'], "'page_size' must be a power of two")):
        with pytest.raises(SystemExit) as e:
            parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "quest", *flags])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_selection_on_gpu_from_outside_needs_the_unverified_flag(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Quest's, OmniKV's and RetroInfer's FlashInfer paths passed the GPU tests: they launch on CUDA. A selection
    method from outside sgl_sparse (one of a user's own, here a renamed Quest): a launch error naming
    --sparse-allow-unverified, which starts it."""
    from sgl_sparse import registry
    from sgl_sparse.methods.selection.quest import Quest

    args, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "quest"])
    assert hand.method == "quest" and args.page_size == 16
    for name in ("omnikv", "retroinfer"):
        _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", name])
        assert hand.method == name

    class OwnQuest(Quest):
        name = "own_quest"

    monkeypatch.setitem(registry._METHODS, "own_quest", OwnQuest)
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "own_quest"])
    err = capsys.readouterr().err
    assert "GPU decode path" in err and "--sparse-allow-unverified" in err
    _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "own_quest",
                          "--sparse-allow-unverified"])
    assert hand.method == "own_quest"
    _, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "own_quest"])
    assert hand.method == "own_quest"


def test_quantized_layouts_with_gpu_kernels_serve_on_gpu(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_kv, kivi and turboquant passed their GPU tests: they launch on CUDA (their speed is the docs'
    business); a layout without GPU kernels (the lossless test store): a launch error even with
    --sparse-allow-unverified; one with kernels from outside sgl_sparse: a launch error naming that flag, which
    starts it."""
    for name in ("fp8_kv", "kivi", "turboquant"):
        _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", name])
        assert hand.method == name and hand.prefill_cuda_graph_off
    monkeypatch.setenv("SGLSPARSE_METHOD_MODULES", "tests.plain_store")
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "plain_store",
                    "--sparse-allow-unverified"])
    assert "GPU kernels are not written yet" in capsys.readouterr().err
    from sgl_sparse import registry
    from sgl_sparse.methods.quantization.fp8_kv import FP8KV

    class OwnFP8(FP8KV):
        name = "own_fp8"

    monkeypatch.setitem(registry._METHODS, "own_fp8", OwnFP8)
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "own_fp8"])
    err = capsys.readouterr().err
    assert "--sparse-method own_fp8: its KV layout's GPU kernels have not run on hardware" in err
    assert "--sparse-allow-unverified" in err
    _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "own_fp8",
                          "--sparse-allow-unverified"])
    assert hand.method == "own_fp8"


def test_palu_alone_and_under_eviction_serves_on_gpu() -> None:
    """Palu alone and under an eviction method have passed their GPU tests (tests/gpu/test_gpu_palu.py): no
    launch error on CUDA."""
    for name in ("palu", "snapkv+palu"):
        _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", name])
        assert hand.method == name


def test_a_composition_launches_on_cpu_and_hands_off_both_members() -> None:
    """An eviction method over a per-token store: one name, the config keyed by member; the scheduler rebuilds
    the same composition from the hand-off (the fingerprint covers both members)."""
    from sgl_sparse.registry import create_method

    cfg = '{"snapkv": {"budget": 1024}, "turboquant": {"bits": 4}}'
    args, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "turboquant+snapkv",
                             "--sparse-config", cfg])
    assert hand.method == "snapkv+turboquant" and args.page_size == 1
    assert hand.config["snapkv"]["budget"] == 1024 and hand.config["turboquant"]["bits"] == 4
    assert hand.prefill_cuda_graph_off == "no CUDA graphs on CPU"
    assert args.max_running_requests is None  # no per-request buffers
    rebuilt = create_method(hand.method, hand.config)
    assert rebuilt.config.fingerprint() == create_method("snapkv+turboquant", cfg).config.fingerprint()


@pytest.mark.parametrize(("method", "config", "message"), [
    ("snapkv+streamingllm", None, "snapkv and streamingllm both evict"),
    ("quest+fp8_kv", None, "quest is a dynamic selection method"),
    ("fp8_kv+kivi", None, "fp8_kv and kivi both own the KV layout"),
    ("snapkv+nope", None, "unknown sparse method 'nope'"),
    ("snapkv+fp8_kv", '{"budget": 512}', "key(s) ['budget'] are not members of the composition"),
    ("snapkv+kivi", '{"snapkv": {"budget": 1024}, "kivi": {"bits": 4}}',
     "snapkv+kivi evicts over KIVIStore's layout, which cannot be served: KIVI quantizes keys per channel over "
     "each 32-token page"),
    ("streamingllm+kivi", None, "frees whole pages"),
])
def test_bad_compositions_are_argparse_errors(method: str, config: str | None, message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model-path", "m", "--device", "cpu", "--sparse-method", method]
    with pytest.raises(SystemExit) as e:
        parse_args([*flags, *(["--sparse-config", config] if config else [])])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--sparse-method {method}: " in err and message in err, err


def test_a_composition_over_a_tested_layout_serves_on_gpu() -> None:
    """A composition needs nothing beyond its members: fp8_kv's and turboquant's GPU tests passed."""
    for method in ("snapkv+fp8_kv", "snapkv+turboquant"):
        _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", method])
        assert hand.method == method


def test_replay_forwards_serve_on_gpu_without_an_opt_in() -> None:
    """KVzip and a prune's kvzip_global on CUDA (tests/gpu/test_gpu_kvzip.py)."""
    _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "kvzip"])
    assert hand.replay_prune_problem is None
    _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "snapkv"])
    assert hand.replay_prune_problem is None  # kvzip_global prunes too


def test_skipkv_on_gpu_with_decode_graphs_off_is_accepted() -> None:
    args, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "skipkv",
                             "--cuda-graph-backend-decode", "disabled"])
    assert hand.method == "skipkv" and args.cuda_graph_backend_prefill == "disabled"


@pytest.mark.parametrize("argv", [
    ["--sparse-method", "h2o"],  # evict_interval 1,024: scores decode queries
    ["--sparse-method", "rkv"],
    ["--sparse-method", "skipkv"],
    [*SNAPKV_DECODE],
    ["--sparse-request-methods", "eviction", "--sparse-request-decode-window", "128"],  # a request may choose h2o
])
def test_decode_observers_keep_decode_graphs_and_get_a_request_cap(argv: list[str]) -> None:
    """Decode queries go to a device ring written inside the decode graph (integration/capture.py), so decode
    graphs stay on; the ring's rows are accounted for --max-running-requests, which gets a default."""
    args, _ = parse_args(["--model-path", "m", "--device", "cuda", *argv])
    assert args.cuda_graph_backend_decode is None and not args.disable_cuda_graph
    assert args.max_running_requests == DEFAULT_RUNNING_REQUESTS
    args, _ = parse_args(["--model-path", "m", "--device", "cuda", *argv, "--max-running-requests", "96"])
    assert args.max_running_requests == 96
    args, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", "snapkv"])
    assert args.max_running_requests is None  # prompt-only observation, nothing per request on CUDA: no ring
    assert hand.request_decode_window == 0


def test_the_request_decode_window_defaults_by_device_and_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    args, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "snapkv"])
    assert hand.request_decode_window == 128 and args.max_running_requests == DEFAULT_RUNNING_REQUESTS
    _, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", "snapkv",
                          "--sparse-request-decode-window", "0"])
    assert hand.request_decode_window == 0
    assert json.loads(hand.dump())["request_decode_window"] == 0
    for flags, words in ((["--sparse-request-decode-window", "-1"], "must be >= 0"),
                         (["--sparse-method", "snapkv", "--sparse-request-methods", "off",
                           "--sparse-request-decode-window", "64"], "requests choose no method here")):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "m", "--device", "cpu", *flags])
        assert words in capsys.readouterr().err


def test_skipkv_boundary_ids_come_from_the_served_tokenizer(tiny_model: str) -> None:
    """An empty ``boundary_token_ids`` (the default) is filled at launch with the tokenizer's ids whose text closes
    a sentence, in a composition's member too; an explicit list and a server without a tokenizer keep theirs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    args, hand = parse_args(["--model-path", tiny_model, "--device", "cpu", "--sparse-method", "skipkv"])
    ids = with_boundary_ids(hand, args).config["boundary_token_ids"]
    assert ids and all(tok.decode([i]).rstrip(" \t").endswith((".", "!", "?", "\n")) for i in ids)
    assert tok.convert_tokens_to_ids(".") in ids and tok.convert_tokens_to_ids("the") not in ids
    assert len(ids) < len(tok) // 4
    args, hand = parse_args(["--model-path", tiny_model, "--device", "cpu", "--sparse-method", "skipkv+fp8_kv"])
    assert with_boundary_ids(hand, args).config["skipkv"]["boundary_token_ids"] == ids
    args, hand = parse_args(["--model-path", tiny_model, "--device", "cpu", "--sparse-method", "skipkv",
                             "--sparse-config", '{"boundary_token_ids": [7]}'])
    assert with_boundary_ids(hand, args).config["boundary_token_ids"] == [7]
    args, hand = parse_args(["--model-path", tiny_model, "--device", "cpu", "--sparse-method", "skipkv",
                             "--skip-tokenizer-init"])
    assert with_boundary_ids(hand, args).config["boundary_token_ids"] == []


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "h2o", "rkv", "skipkv", "pyramidkv"])
def test_eviction_with_tensor_parallelism(method: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every eviction method launches with --tp-size 2 on CPU (its scores are summed over the TP group); on CUDA
    it has not run yet: a launch error naming --sparse-allow-unverified and the reason, which starts it."""
    _, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-method", method, "--tp-size", "2"])
    assert hand.method == method
    _, hand = parse_args(["--model-path", "m", "--device", "cpu", "--sparse-request-methods", "eviction",
                          "--tp-size", "2"])
    assert hand.request_methods == "eviction"
    if method == "pyramidkv":  # refused on CUDA whatever the TP size (its per-layer selection)
        return
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", method, "--tp-size", "2"])
    err = capsys.readouterr().err
    assert "has not yet run on more than one GPU; see docs/parallelism.md (--sparse-allow-unverified starts it)" in err
    _, hand = parse_args(["--model-path", "m", "--device", "cuda", "--sparse-method", method, "--tp-size", "2",
                          "--cuda-graph-backend-decode", "disabled", "--sparse-allow-unverified"])
    assert hand.method == method


def test_an_fp8_kv_cache_from_the_checkpoint_is_refused_under_auto() -> None:
    """SGLang resolves ``--kv-cache-dtype auto`` to FP8 for a checkpoint whose quant config says
    ``kv_cache_quant_algo: FP8`` (mem_cache/kv_cache_dtype.py, called below as the model runner does), after the
    launcher checked the flag: the backend factory refuses it, naming the flag to pass."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    from sgl_sparse.integration.backends import checkpoint_kv_dtype_problem

    def runner(flag: str, algo: str | None) -> SimpleNamespace:
        model = torch.nn.Module()
        model.quant_config = SimpleNamespace(kv_cache_quant_algo=algo)
        _, dtype = configure_kv_cache_dtype(server_args_kv_cache_dtype=flag, model=model, model_dtype=torch.bfloat16,
                                            is_draft_worker=False, is_dflash=False,
                                            speculative_draft_attention_backend=None)
        return SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype=flag), kv_cache_dtype=dtype)

    why = checkpoint_kv_dtype_problem(runner("auto", "FP8"))
    assert why is not None and "--kv-cache-dtype fp8_e4m3" in why
    assert checkpoint_kv_dtype_problem(runner("auto", None)) is None  # the model dtype
    assert checkpoint_kv_dtype_problem(runner("fp8_e4m3", "FP8")) is None  # the flag the launcher checked
