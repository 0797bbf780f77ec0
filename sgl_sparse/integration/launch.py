"""``python -m sgl_sparse.launch_server``: every ``sglang.launch_server`` flag plus ours.

Validates ``--sparse-method``/``--sparse-config`` with argparse errors before anything heavy runs,
selects our radix-cache and attention backends, hands the config to the scheduler processes through
the environment (:mod:`.handoff`) and then runs SGLang's own ``run_server``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sgl_sparse.contract import KVStore, PageSelector
from sgl_sparse.errors import SparseConfigError
from sgl_sparse.integration import BACKEND_NAME, handoff
from sgl_sparse.registry import create_method, registered_methods
from sgl_sparse.request_methods import EVICTION, FLAG, POLICIES, default_policy, policy_problem
from sgl_sparse.rules import PER_REQUEST_DECODE_WINDOW, decode_window, pool_page_size

PROG = "python -m sgl_sparse.launch_server"


def build_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="SGLang server with sgl_sparse's KV-cache methods. Takes every `sglang serve` flag.",
    )
    ServerArgs.add_cli_args(parser)
    group = parser.add_argument_group(
        "sgl_sparse", "Sparse KV-cache method (selects the 'sgl_sparse' radix-cache and attention backends)"
    )
    group.add_argument(
        "--sparse-method",
        default="dense",
        metavar="NAME",
        help=f"KV-cache method. Registered: {', '.join(registered_methods())}. Default: dense. An eviction method "
        "over a quantization method's pool is their names joined by '+' (e.g. snapkv+fp8_kv).",
    )
    group.add_argument(
        "--sparse-config",
        default=None,
        metavar="JSON|PATH",
        help="The method's config fields as a JSON object, or a path to a JSON file. "
        "Unset fields keep the method's defaults. A composition's config is keyed by member name "
        "(e.g. '{\"snapkv\": {\"budget\": 1024}, \"fp8_kv\": {}}').",
    )
    group.add_argument(
        FLAG,
        default=None,
        choices=POLICIES,
        help="Whether a request may choose its own method through custom_params (sgl_sparse_method, "
        "sgl_sparse_config): 'eviction' lets it pick dense or any eviction method; 'off' serves --sparse-method to "
        "every request. Default: eviction when --sparse-method is an eviction method, else off (on a dense "
        "server 'eviction' replaces SGLang's stock attention lists by compacted ones).",
    )
    group.add_argument(
        "--sparse-request-decode-window",
        type=int,
        default=None,
        metavar="N",
        help=f"With {FLAG} eviction: the decode queries a method chosen per request may score (its window_size, "
        "e.g. h2o's 128). Each request row then keeps that many queries per layer on the device, from the KV "
        f"budget, and --max-running-requests defaults to {DEFAULT_RUNNING_REQUESTS}. Default: "
        f"{PER_REQUEST_DECODE_WINDOW} on CPU, 0 on CUDA (a request that asks for decode scoring gets HTTP 400).",
    )
    group.add_argument(ALLOW_UNVERIFIED, action="store_true", help=ALLOW_UNVERIFIED_HELP)
    return parser


# The stock backends ours wraps, per device; the first is the default. SGLang's others build their KV
# index lists from raw req_to_token rows, which hold sentinel slots after eviction.
BASES: dict[str, tuple[str, ...]] = {"cuda": ("flashinfer", "triton"), "cpu": ("torch_native",)}
DISABLED = "disabled"  # sglang.srt.model_executor.cuda_graph_config.Backend.DISABLED


def _resolve_device(args: argparse.Namespace) -> str:
    if args.device is not None:
        return str(args.device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def requested_graph_backend(args: argparse.Namespace, phase: str) -> str | None:
    """The CUDA-graph backend the parsed flags ask for in ``phase`` ("decode"/"prefill"); None leaves it to
    SGLang's default (decode "full", prefill "breakable" on CUDA). Same precedence as SGLang 0.5.17's
    ``ServerArgs._parse_cuda_graph_config`` (server_args.py L4275-4336): ``--cuda-graph-config`` JSON, then
    ``--cuda-graph-backend-<phase>`` (and its deprecated aliases such as ``--disable-piecewise-cuda-graph``),
    then ``--disable-<phase>-cuda-graph``, then ``--disable-cuda-graph``."""
    raw = args.cuda_graph_config
    explicit = raw.to_dict() if hasattr(raw, "to_dict") else (raw or {})
    backend = (explicit.get(phase) or {}).get("backend")
    if backend is None:
        backend = getattr(args, f"cuda_graph_backend_{phase}")
    if backend is None and (getattr(args, f"disable_{phase}_cuda_graph") or args.disable_cuda_graph):
        backend = DISABLED
    return None if backend is None else str(backend)


def choose_base(args: argparse.Namespace, device: str) -> tuple[str | None, list[str]]:
    """The stock backend ours wraps on ``device``, from ``--attention-backend`` (unset or ``sgl_sparse``: the
    device's default), and the argparse errors of the backend flags."""
    supported = BASES.get(device)
    if supported is None:
        return None, [f"--device {device}: sgl_sparse serves on {' and '.join(BASES)} only"]
    names = " or ".join(supported)
    chosen = args.attention_backend
    if chosen in (None, BACKEND_NAME):
        base = supported[0]
    elif chosen in supported:
        base = chosen
    else:
        default = f" (default {supported[0]})" if len(supported) > 1 else ""
        return None, [f"--attention-backend {chosen}: on {device} sgl_sparse wraps {names}{default}, the backends "
                      "its compaction of evicted slots is built for"]
    problems = []
    for flag, value in (("--prefill-attention-backend", args.prefill_attention_backend),
                        ("--decode-attention-backend", args.decode_attention_backend)):
        if value in (None, BACKEND_NAME, base):
            continue
        hint = f"pass --attention-backend {value} to use it for both" if value in supported else "drop the flag"
        problems.append(f"{flag} {value}: sgl_sparse serves prefill and decode through one base backend (on "
                        f"{device}: {names}), here {base}; {hint}")
    return base, problems


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, handoff.Handoff]:
    """Parse and validate; exits with an argparse error (status 2) on bad input."""
    parser = build_parser()
    if "--config" in argv:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger

        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    args = parser.parse_args(argv)
    try:
        method = create_method(args.sparse_method, args.sparse_config)
        if resolved := method.for_model(args.model_path):
            method = create_method(args.sparse_method, {**method.config.to_dict(), **resolved})
    except SparseConfigError as e:
        parser.error(str(e))
    if args.radix_cache_backend not in (None, BACKEND_NAME):
        parser.error(f"--radix-cache-backend {args.radix_cache_backend}: sgl_sparse serves through its own "
                     f"backend '{BACKEND_NAME}'; drop the flag (use `python -m sglang.launch_server` for stock "
                     "SGLang)")
    policy = args.sparse_request_methods or default_policy(method)
    if (why := policy_problem(method, policy)) is not None:
        parser.error(why)
    # A server that serves no eviction method itself but lets requests choose one: the family's needs
    # (prefill query capture, compacted lists) come from a representative of it.
    probe = create_method("snapkv") if policy == EVICTION and not method.evicts else None
    page_size = pool_page_size(method)
    if args.page_size not in (None, page_size):
        why = (f"its page metadata is per {page_size}-token page (set by its config's page_size)" if page_size > 1
               else "eviction frees single slots" if method.evicts else "only page-based methods use other sizes")
        parser.error(f"--page-size {args.page_size}: --sparse-method {method.name} is served with page size "
                     f"{page_size} ({why}); drop the flag")
    if (args.chunked_prefill_size or 0) > 0 and args.chunked_prefill_size % page_size:
        parser.error(f"--chunked-prefill-size {args.chunked_prefill_size}: --sparse-method {method.name} is served "
                     f"with page size {page_size}, and SGLang cuts prefill chunks in whole pages; use a multiple of "
                     f"{page_size}")
    device = _resolve_device(args)
    base, problems = choose_base(args, device)
    problems += unsupported_combinations(args, method, device)
    if probe is not None:
        problems += [f"{FLAG} eviction (requests may choose e.g. snapkv): {p}"
                     for p in unsupported_combinations(args, probe, device) if p not in problems]
    for problem in problems:
        parser.error(problem)
    assert base is not None  # choose_base reports a problem whenever it has no base
    prefill_off = None
    if device == "cpu":
        # Our backend name is not torch_native, so SGLang would keep CUDA graphs on (server_args.py
        # L5751-5763), which cannot run on CPU; unsupported_combinations rejected an explicit graph backend.
        if requested_graph_backend(args, "prefill") != DISABLED:
            prefill_off = "no CUDA graphs on CPU"
        args.disable_cuda_graph = True
    elif ((method.observation_window() > 0 or method.evicts or probe is not None)
          and requested_graph_backend(args, "prefill") is None):
        # A replayed prefill graph runs attention on a static ForwardBatch without rids
        # (model_executor/runner/prefill_cuda_graph_runner.py L1481-1539), so the window queries the method
        # scores would never be captured; on any evicting server a request's own prune with a scored keep
        # (custom_params sgl_sparse_prune, policy snapkv_global) reads them too. Set as
        # --cuda-graph-backend-prefill disabled would.
        args.cuda_graph_backend_prefill = DISABLED
        prefill_off = (f"{method.name} captures prefill queries" if method.observation_window() > 0 else
                       f"per-request eviction methods ({FLAG} eviction) capture prefill queries" if probe else
                       "a request's own prune (custom_params sgl_sparse_prune) may score its ranges with the "
                       "prompt's last queries")
        prefill_off += ", which a replayed prefill graph skips"
    elif method.store is not None and requested_graph_backend(args, "prefill") is None:
        # Our extend over a method-owned layout reads the new tokens through FlashInfer's ragged prefill,
        # which SGLang plans only outside piecewise prefill graphs (flashinfer_backend.py L959-963), and
        # builds its prefix lists from the host's extend lengths.
        args.cuda_graph_backend_prefill = DISABLED
        prefill_off = f"{method.name}'s extend attention (ragged new tokens + its quantized prefix) runs eagerly"
    request_window = args.sparse_request_decode_window
    if request_window is None:
        request_window = PER_REQUEST_DECODE_WINDOW if device == "cpu" and policy == EVICTION else 0
    elif request_window < 0 or (request_window > 0 and policy != EVICTION):
        parser.error(f"--sparse-request-decode-window {request_window}: "
                     + ("must be >= 0" if request_window < 0 else f"requests choose no method here ({FLAG} {policy})"))
    if ((method.store is not None and type(method.store).fixed_bytes is not KVStore.fixed_bytes
         or method.selector is not None and type(method.selector).fixed_bytes is not PageSelector.fixed_bytes
         or decode_window(method, request_window) > 0) and args.max_running_requests is None):
        # Per-request buffers (KIVI's residual, PyramidKV's layer sets, the decode query ring) are accounted for
        # --max-running-requests rows before the pool is sized, so it must be known then.
        args.max_running_requests = DEFAULT_RUNNING_REQUESTS
    args.attention_backend = BACKEND_NAME
    # Both None, so SGLang resolves prefill and decode to our backend: a prefill == decode pair would
    # otherwise replace --attention-backend (arg_groups/overrides.py L2014-2018).
    args.prefill_attention_backend = args.decode_attention_backend = None
    args.radix_cache_backend = BACKEND_NAME
    args.page_size = page_size
    return args, handoff.Handoff(method.name, method.config.to_dict(), device, base=base,
                                 prefill_cuda_graph_off=prefill_off, request_methods=policy,
                                 request_decode_window=request_window,
                                 scored_prune_problem=scored_prune_problem(args, device),
                                 replay_prune_problem=replay_prune_problem(args, method, device, policy))


BOUNDARY_FIELD = "boundary_token_ids"  # a method config's sentence-boundary ids (skipkv); empty: derived here


def with_boundary_ids(hand: handoff.Handoff, args: argparse.Namespace) -> handoff.Handoff:
    """Fill an empty ``boundary_token_ids`` of the served config (a composition's member too) from the served
    tokenizer: every vocabulary id whose text closes a sentence (``skipkv.boundary_ids``). Done once here, in
    the launcher, so that the scheduler gets the filled list in the config (its fingerprint covers it,
    ``/server_info`` shows it) and the method needs no tokenizer. Left empty (the method then cuts fixed
    segments) when the server has no tokenizer."""
    configs = [hand.config, *(v for v in hand.config.values() if isinstance(v, dict))]
    targets = [c for c in configs if c.get(BOUNDARY_FIELD) == []]
    if not targets:
        return hand
    logger = logging.getLogger(__name__)
    if getattr(args, "skip_tokenizer_init", False):
        logger.warning("sgl_sparse: --skip-tokenizer-init: no sentence boundary ids for %s, fixed segments instead",
                       hand.method)
        return hand
    from transformers import AutoTokenizer

    from sgl_sparse.methods.eviction.skipkv import boundary_ids

    tok = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path,
                                        trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    ids = boundary_ids([tok.decode([i]) for i in range(len(tok))])
    for c in targets:
        c[BOUNDARY_FIELD] = ids
    # Re-validated as the scheduler will build it (create_method raises on a bad list).
    create_method(hand.method, hand.config)
    logger.info("sgl_sparse: %d sentence boundary token ids from the tokenizer", len(ids))
    return hand


REPLAY_FIELDS = ("prompt_ids", "next_prompt_ids", "postfix_ids")  # kvzip's replay prompts; empty: derived here


def replay_prompt_ids(args: argparse.Namespace) -> dict[str, list[int]]:
    """KVzip's replay instructions tokenized by the served tokenizer: its two reconstruction instructions, and as
    the postfix the chat template's text between a user message and the assistant's reply (its generation prompt
    included), else the original's fallback."""
    from transformers import AutoTokenizer

    from sgl_sparse.methods.eviction.kvzip import FALLBACK_POSTFIX, FIRST_PROMPT, NEXT_PROMPT

    tok = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path,
                                        trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    postfix = FALLBACK_POSTFIX
    if getattr(tok, "chat_template", None):
        mark = "\x00KVZIP\x00"
        text = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                       add_generation_prompt=True)
        if isinstance(text, str) and mark in text:
            postfix = text.split(mark, 1)[1]
    texts = {"prompt_ids": FIRST_PROMPT, "next_prompt_ids": NEXT_PROMPT, "postfix_ids": postfix}
    return {f: list(tok.encode(texts[f], add_special_tokens=False)) for f in REPLAY_FIELDS}


def with_replay_prompts(hand: handoff.Handoff, args: argparse.Namespace) -> handoff.Handoff:
    """Fill kvzip's empty replay prompts from the served tokenizer (as :func:`with_boundary_ids` does SkipKV's
    boundaries), and, where a request's own prune may keep by ``kvzip_global``, hand the scheduler the same
    instructions for its replays."""
    needs_method = hand.method == "kvzip" and any(hand.config.get(f) == [] for f in REPLAY_FIELDS)
    needs_prune = hand.replay_prune_problem is None
    if not (needs_method or needs_prune):
        return hand
    logger = logging.getLogger(__name__)
    if getattr(args, "skip_tokenizer_init", False):
        if needs_method:
            logger.warning("sgl_sparse: --skip-tokenizer-init: kvzip's replays carry no instruction unless its "
                           "config gives prompt_ids, next_prompt_ids and postfix_ids")
        return dataclasses.replace(hand, replay_prune_problem="--skip-tokenizer-init: no tokenizer for KVzip's "
                                                              "reconstruction instructions")
    try:
        ids = replay_prompt_ids(args)
    except Exception as e:  # noqa: BLE001 (a tokenizer or template of any kind may fail here)
        if needs_method:
            raise
        # Only kvzip_global prunes need them: the server starts, and such a request is refused saying why.
        logger.warning("sgl_sparse: kvzip_global prunes not served: KVzip's instructions could not be tokenized "
                       "(%s: %s)", type(e).__name__, e)
        return dataclasses.replace(hand, replay_prune_problem=f"KVzip's instructions could not be tokenized "
                                                              f"({type(e).__name__}: {e})")
    if needs_method:
        for f in REPLAY_FIELDS:
            if hand.config.get(f) == []:
                hand.config[f] = ids[f]
        create_method(hand.method, hand.config)  # re-validated as the scheduler will build it
        logger.info("sgl_sparse: kvzip replay prompts from the tokenizer: %s", {f: len(ids[f]) for f in REPLAY_FIELDS})
    if needs_prune:
        hand = dataclasses.replace(hand, replay_prompts=ids)
    return hand


# --max-running-requests for a server with per-request buffers (a store's, the decode query ring) when the flag
# is not given.
DEFAULT_RUNNING_REQUESTS = 64

# The one switch for combinations that have not run on hardware yet (see UNVERIFIED below).
ALLOW_UNVERIFIED = "--sparse-allow-unverified"
ALLOW_UNVERIFIED_HELP = (
    "Start combinations that have not run on hardware yet, which are otherwise launch errors naming this flag: "
    "an eviction method with --tp-size > 1 on CUDA, on CUDA a selection method or a quantized KV layout "
    "loaded from outside sgl_sparse (SGLSPARSE_METHOD_MODULES), and palu under an eviction method on CUDA (palu alone "
    "has run there). See docs/parallelism.md and docs/methods/palu.md.")


@dataclass(frozen=True)
class Launch:
    """What a check reads: the parsed flags, the method (the served one, or the representative of the methods
    requests may choose) and the device."""

    args: argparse.Namespace
    method: Any
    device: str

    @property
    def name(self) -> str:
        return str(self.method.name)

    @property
    def gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def kv_dtype(self) -> str:
        return str(self.args.kv_cache_dtype or "auto")

    @property
    def unverified_allowed(self) -> bool:
        return bool(getattr(self.args, "sparse_allow_unverified", False))

    def graph(self, phase: str) -> str | None:
        return requested_graph_backend(self.args, phase)

    def graph_on(self, phase: str) -> bool:
        """An explicit graph backend other than disabled for ``phase``."""
        return self.graph(phase) not in (None, DISABLED)


def _from_outside(obj: Any) -> bool:
    """Defined outside sgl_sparse (a module of SGLSPARSE_METHOD_MODULES): no GPU test of ours has run it."""
    return not type(obj).__module__.startswith("sgl_sparse.")


class Check(NamedTuple):
    """One combination sgl_sparse cannot serve: ``when`` it applies (truthy), ``say`` the argparse error."""

    when: Callable[[Launch], object]
    say: Callable[[Launch], str]


def _hooks_problem(c: Launch) -> str | None:
    from sgl_sparse.rules import served_hooks_problem

    return served_hooks_problem(c.method)


# Replay forwards (KVzip's reconstruction, integration/replay.py; a method's or a prune's kvzip_global). On CUDA
# too; --tp-size > 1 takes the scores' maximum over the ranks (tests/test_tp_e2e.py), --dp-size > 1 runs them on
# the rank that holds the request.
REPLAY: tuple[Check, ...] = (
    Check(lambda c: c.method.store is not None,
          lambda c: "replay forwards over a method-owned KV layout are not served yet"),
    # A replay's extend would write the selector's metadata and read its static sets (PyramidKV): never run.
    Check(lambda c: c.method.selector is not None,
          lambda c: f"replay forwards through {c.name}'s per-layer selector are not served yet"),
)

def _replays(r: Check) -> Check:
    """A method that runs replays, where ``r`` refuses them."""
    return Check(lambda c: c.method.runs_replays and r.when(c), lambda c: f"--sparse-method {c.name}: {r.say(c)}")


def _graphs_on_cpu(phase: str) -> Check:
    return Check(lambda c: not c.gpu and c.graph_on(phase),
                 lambda c: f"{phase} CUDA graph backend {c.graph(phase)} on CPU: CUDA graphs cannot run on CPU; "
                           "drop the flag (the launcher turns CUDA graphs off on CPU)")


# sgl_sparse's own eviction methods with per-layer selection whose decode kernel has passed the GPU tests.
GPU_VERIFIED_LAYER_SETS: tuple[str, ...] = ("pyramidkv",)  # tests/gpu/test_gpu_pyramidkv.py


def _gpu_verified(method: Any) -> bool:
    return method.name in GPU_VERIFIED_LAYER_SETS and not _from_outside(method)


# Combinations that have not run on hardware yet: each starts with ALLOW_UNVERIFIED.
_OUTSIDE_SELECTION = Check(
    lambda c: c.method.selector is not None and not c.method.evicts and c.gpu and _from_outside(c.method),
    lambda c: f"--sparse-method {c.name}: its GPU decode path (page selection read through FlashInfer) has "
              "not run on hardware: it is loaded from outside sgl_sparse (SGLSPARSE_METHOD_MODULES), and "
              "only sgl_sparse's own selection methods have passed the GPU tests (tests/gpu/); it serves on "
              f"--device cpu, or on CUDA with {ALLOW_UNVERIFIED}")
_OUTSIDE_LAYOUT = Check(
    lambda c: (c.method.store is not None and c.gpu and c.method.store.gpu_kernels
               and _from_outside(getattr(c.method, "quantization", c.method))),
    lambda c: f"--sparse-method {c.name}: its KV layout's GPU kernels have not run on hardware: it is "
              "loaded from outside sgl_sparse (SGLSPARSE_METHOD_MODULES), and only sgl_sparse's own layouts "
              f"have passed the GPU tests (tests/gpu/); it serves on --device cpu, or on CUDA with "
              f"{ALLOW_UNVERIFIED}")
# Every rank sums its scores over the TP group before selecting (integration/tp.py), tested with two gloo
# ranks on CPU (tests/test_tp_eviction.py).
_TP_EVICTION = Check(
    lambda c: c.method.evicts and (c.args.tp_size or 1) > 1 and c.gpu,
    lambda c: f"--tp-size {c.args.tp_size} with {c.name}: eviction under tensor parallelism (scores summed "
              "over the TP group, so every rank keeps the same tokens) has not yet run on more than one GPU; "
              f"see docs/parallelism.md ({ALLOW_UNVERIFIED} starts it)")
_OUTSIDE_LAYER_SETS = Check(
    lambda c: c.method.selector is not None and c.method.evicts and c.gpu and not _gpu_verified(c.method),
    lambda c: f"--sparse-method {c.name}: eviction with per-layer selection loaded from outside sgl_sparse "
              "(SGLSPARSE_METHOD_MODULES) has not run on a GPU; only PyramidKV's layer sets have passed the GPU "
              f"tests (tests/gpu/test_gpu_pyramidkv.py); it serves on --device cpu, or on CUDA with "
              f"{ALLOW_UNVERIFIED}")
UNVERIFIED: tuple[Check, ...] = (_OUTSIDE_SELECTION, _OUTSIDE_LAYOUT, _TP_EVICTION, _OUTSIDE_LAYER_SETS)

_FP8 = "fp8"

# What sgl_sparse cannot serve, in the order the launcher reports them (file:line refer to sglang/srt/ of SGLang
# 0.5.17). A predicate that must exclude an earlier one says so (the kv-dtype and store rows).
UNSUPPORTED: tuple[Check, ...] = (
    Check(lambda c: _hooks_problem(c) is not None,
          lambda c: f"--sparse-method {c.name}: {_hooks_problem(c)}"),
    Check(lambda c: c.method.selector is not None and c.gpu and c.args.attention_backend == "triton",
          lambda c: f"--attention-backend triton with {c.name}: its decode reads a selection, which sgl_sparse "
                    "serves on the flashinfer base (CUDA) and torch_native (CPU); drop the flag"),
    _OUTSIDE_LAYER_SETS,
    _OUTSIDE_SELECTION,
    *(_replays(r) for r in REPLAY),
    Check(lambda c: c.args.enable_hierarchical_cache,
          lambda c: "--enable-hierarchical-cache: HiCache is not supported with sgl_sparse yet"),
    Check(lambda c: c.args.enable_session_radix_cache or c.args.enable_streaming_session,
          lambda c: "session radix caches / streaming sessions are not supported with sgl_sparse yet"),
    Check(lambda c: c.args.speculative_algorithm,
          lambda c: f"--speculative-algorithm {c.args.speculative_algorithm}: speculative decoding is not "
                    "supported with sgl_sparse: SGLang picks draft attention backends by name "
                    "(speculative/draft_utils.py L44-58) and has none for 'sgl_sparse', and its draft and verify "
                    "paths build KV index lists from raw req_to_token rows, which hold sentinel slots after "
                    "eviction"),
    Check(lambda c: (c.args.pp_size or 1) > 1,
          lambda c: f"--pp-size {c.args.pp_size}: pipeline parallelism is not supported with sgl_sparse: a stage "
                    "holds only its own layers, while the eviction step and observation windows work on all layers "
                    "in one process"),
    Check(lambda c: (c.args.dcp_size or 1) > 1,
          lambda c: f"--dcp-size {c.args.dcp_size}: decode context parallelism is not supported with sgl_sparse: "
                    "it builds per-rank KV index lists from raw req_to_token rows "
                    "(layers/attention/triton_backend.py L356-384), bypassing our compaction"),
    Check(lambda c: c.args.disaggregation_mode not in (None, "null"),
          lambda c: f"--disaggregation-mode {c.args.disaggregation_mode}: PD disaggregation is not supported with "
                    "sgl_sparse: KV transfer sends req_to_token rows as slot ids, which hold sentinel slots after "
                    "eviction, and the method state stays on the prefill server"),
    Check(lambda c: c.args.enable_dp_attention,
          lambda c: "--enable-dp-attention: DP attention is not supported with sgl_sparse yet (untested: "
                    "attention-DP ranks run idle and padded batches our runtime was never checked against)"),
    Check(lambda c: c.args.enable_mis,
          lambda c: "--enable-mis: multi-item scoring is not supported with sgl_sparse: it needs SGLang's "
                    "flashinfer backend by name (server_args.py L4600-4604) and masks by logical positions "
                    "(layers/attention/flashinfer_backend.py L559-689)"),
    Check(lambda c: "fp4" in c.kv_dtype,
          lambda c: f"--kv-cache-dtype {c.kv_dtype}: FP4 KV is not supported with sgl_sparse: FlashInfer's FP4 "
                    "dequant workspaces read raw req_to_token rows (layers/attention/flashinfer_backend.py L1269, "
                    "L1429; mem_cache/memory_pool.py L2557-2679)"),
    Check(lambda c: c.kv_dtype == "mxfp8",
          lambda c: "--kv-cache-dtype mxfp8: only SGLang's fa4 backend reads MXFP8 KV (its block scales); "
                    "sgl_sparse wraps flashinfer, triton or torch_native"),
    Check(lambda c: c.kv_dtype.startswith(_FP8) and "fp4" not in c.kv_dtype and c.method.observation_window() > 0,
          lambda c: f"--kv-cache-dtype {c.kv_dtype} with {c.name}: its scores read the raw FP8 keys and ignore "
                    "k_scale (sgl_sparse/kernels/window_scores.py); use the model dtype or a method without an "
                    "observation window"),
    Check(lambda c: (c.kv_dtype.startswith(_FP8) and "fp4" not in c.kv_dtype and c.method.observation_window() == 0
                     and (c.method.selector is not None or c.method.runs_replays)),
          lambda c: f"--kv-cache-dtype {c.kv_dtype} with {c.name}: its "
                    + ("page summaries and scores are kept in the KV dtype and read the raw FP8 keys"
                       if c.method.selector is not None else "replay scores read the raw FP8 keys")
                    + " (k_scale ignored); use the model dtype, or fp8_kv (our FP8 layout, per-token scales)"),
    Check(lambda c: c.method.store is not None and c.gpu and not c.method.store.gpu_kernels,
          lambda c: f"--sparse-method {c.name}: its GPU kernels are not written yet (its layout runs in plain "
                    "torch, which cannot run inside CUDA graphs); it serves on --device cpu"),
    _OUTSIDE_LAYOUT,
    Check(lambda c: c.method.store is not None and c.method.store.reads_whole_tokens and (c.args.tp_size or 1) > 1,
          lambda c: f"--tp-size {c.args.tp_size} with {c.name}: its layout encodes every KV head of a token together, "
                    "and a tensor-parallel rank holds a share of them; use --tp-size 1 (or --dp-size)"),
    Check(lambda c: c.method.store is not None and c.kv_dtype != "auto",
          lambda c: f"--kv-cache-dtype {c.kv_dtype} with {c.name}: the method owns the KV layout (its codes and "
                    "scales); drop the flag"),
    Check(lambda c: c.method.store is not None and c.gpu and c.graph_on("prefill"),
          lambda c: f"prefill CUDA graph backend {c.graph('prefill')} with {c.name}: its extend attention runs "
                    "eagerly (the launcher turns prefill CUDA graphs off for it); drop the flag"),
    Check(lambda c: (c.args.tokenizer_worker_num or 1) > 1,
          lambda c: f"--tokenizer-worker-num {c.args.tokenizer_worker_num}: each extra tokenizer worker re-imports "
                    "SGLang's HTTP app (entrypoints/http_server.py L2647-2660) without sgl_sparse's routes "
                    "(/v1/prefix_cache/*); use 1"),
    Check(lambda c: c.args.enable_hisparse,
          lambda c: "--enable-hisparse: SGLang's hierarchical sparse attention manages its own KV layout and index "
                    "lists; it cannot be combined with sgl_sparse's backends"),
    Check(lambda c: c.args.enable_pdmux,
          lambda c: "--enable-pdmux: PD multiplexing builds its own attention backend groups per stream, around "
                    "our backend and runtime; not supported with sgl_sparse"),
    Check(lambda c: c.args.enable_two_batch_overlap or c.args.enable_single_batch_overlap,
          lambda c: "--enable-two-batch-overlap / --enable-single-batch-overlap: micro-batch overlap splits a "
                    "forward into parts our per-step runtime does not see; not supported with sgl_sparse"),
    Check(lambda c: c.args.enable_lmcache or c.args.enable_flexkv,
          lambda c: "--enable-lmcache / --enable-flexkv: SGLang builds these in place of its radix tree, and "
                    "sgl_sparse's tree (--radix-cache-backend sgl_sparse) is built instead, so the external KV "
                    "store would be silently off; not supported with sgl_sparse"),
    Check(lambda c: c.args.enable_deterministic_inference or c.args.rl_on_policy_target,
          lambda c: "--enable-deterministic-inference / --rl-on-policy-target: SGLang's batch-invariant kernels "
                    "are chosen by attention backend name (fa3, flashinfer, triton), not sgl_sparse's; not "
                    "supported with sgl_sparse"),
    Check(lambda c: c.args.enable_torch_compile,
          lambda c: "--enable-torch-compile: torch.compile would trace sgl_sparse's decode-step Python "
                    "(compaction, selection) on CUDA, which has not been tested, and on CPU SGLang's compiled graph "
                    "runner needs backend hooks ours lack; not supported with sgl_sparse yet"),
    Check(lambda c: getattr(c.args, "smg_grpc_mode", False) or getattr(c.args, "grpc_mode", False),
          lambda c: "--grpc-mode / --smg-grpc-mode: the gRPC servicer replaces SGLang's HTTP server and tokenizer "
                    "manager, so sgl_sparse's routes (/v1/prefix_cache/*), request validation and meta_info would "
                    "be missing; serve over HTTP"),
    Check(lambda c: (c.args.attn_cp_size or 1) > 1 or c.args.enable_prefill_cp,
          lambda c: "--attn-cp-size / --enable-prefill-cp: context parallelism writes prefill K/V through SGLang's "
                    "all-gather (set_kv_buffer), past sgl_sparse's write path (selection summaries, eviction "
                    "capture, method-owned layouts); not supported with sgl_sparse"),
    Check(lambda c: getattr(c.args, "dllm_algorithm", None),
          lambda c: f"--dllm-algorithm {c.args.dllm_algorithm}: diffusion LLM decoding replaces the attention "
                    "backend with SGLang's own and changes the page size; not supported with sgl_sparse"),
    Check(lambda c: str(getattr(c.args, "kv_canary", "none") or "none") != "none",
          lambda c: f"--kv-canary {c.args.kv_canary}: the canary walks SGLang's own radix tree classes and reads "
                    "req_to_token rows, which hold sentinel slots after eviction; not supported with sgl_sparse"),
    Check(lambda c: c.method.evicts and getattr(c.args, "strip_thinking_cache", False),
          lambda c: f"--strip-thinking-cache with {c.name}: SGLang then frees the output part of the row itself, "
                    "raw (mem_cache/common.py L178-201), which holds sentinel slots after eviction"),
    Check(lambda c: c.method.evicts and (c.args.num_continuous_decode_steps or 1) > 1,
          lambda c: f"--num-continuous-decode-steps {c.args.num_continuous_decode_steps} with {c.name}: the "
                    "eviction step and its host counters run once per scheduled batch; use 1"),
    _TP_EVICTION,
    *(_graphs_on_cpu(phase) for phase in ("decode", "prefill")),
    Check(lambda c: c.gpu and c.method.observation_window() > 0 and c.graph_on("prefill"),
          lambda c: f"prefill CUDA graph backend {c.graph('prefill')} with {c.name}: a replayed prefill graph has "
                    "no request ids, so the method cannot capture its window queries; drop the flag (the launcher "
                    "turns prefill CUDA graphs off for it)"),
)


def replay_problems(args: argparse.Namespace, method: Any, device: str) -> list[str]:
    """Why replay forwards cannot run on this server; empty when they can."""
    c = Launch(args, method, device)
    return [r.say(c) for r in REPLAY if r.when(c)]


def replay_prune_problem(args: argparse.Namespace, method: Any, device: str, policy: str) -> str | None:
    """Why a request's own prune cannot keep by ``kvzip_global`` here; None when it can (the launcher then tokenizes
    KVzip's instructions for the scheduler)."""
    if not (method.evicts or policy == EVICTION):
        return "this server serves no request prunes"  # prune_problem says why first
    return "; ".join(replay_problems(args, method, device)) or None


def unsupported_combinations(args: argparse.Namespace, method: Any, device: str) -> list[str]:
    """What sgl_sparse cannot serve (:data:`UNSUPPORTED`), as messages for argparse errors, in table order. The
    combinations of :data:`UNVERIFIED` start with ``--sparse-allow-unverified``."""
    c = Launch(args, method, device)
    return [check.say(c) for check in UNSUPPORTED
            if check.when(c) and not (c.unverified_allowed and any(check is u for u in UNVERIFIED))]


def scored_prune_problem(args: argparse.Namespace, device: str) -> str | None:
    """Why a request's own prune cannot keep a scored part of its ranges on this server (checked per request, HTTP
    400 naming custom_params['sgl_sparse_prune']); None when it can. Called after the launcher's graph choices."""
    kv_dtype = str(args.kv_cache_dtype or "auto")
    if kv_dtype.startswith("fp8"):
        return (f"--kv-cache-dtype {kv_dtype}: the scores would read the raw FP8 keys and ignore k_scale; prune "
                "with policy drop, or serve with the model dtype")
    prefill = requested_graph_backend(args, "prefill")
    if device != "cpu" and prefill not in (None, DISABLED):
        return (f"this server replays prefill CUDA graphs (backend {prefill}), which skip the capture of the "
                "prompt's last queries the scores need; prune with policy drop, or start without the flag")
    return None


def main(argv: list[str] | None = None) -> None:
    from sglang.srt.plugins import load_plugins

    from sgl_sparse.integration.plugin import check_registered, mp_start_method

    argv = sys.argv[1:] if argv is None else argv
    try:
        mp_start_method()  # the plug-in would only log this, and then not register
    except RuntimeError as e:
        raise SystemExit(f"sgl_sparse: {e}") from None
    load_plugins()
    check_registered()
    args, hand = parse_args(argv)
    hand = with_boundary_ids(hand, args)
    hand = with_replay_prompts(hand, args)
    handoff.publish(hand)  # before ServerArgs: its __post_init__ and the spawned children read it
    from sglang.srt.entrypoints.http_server import app

    from sgl_sparse.integration import prune_route

    # Prefix-Cache Pruning: our routes on SGLang's app and their communicator, before the TokenizerManager exists.
    prune_route.register_communicator()
    prune_route.install_routes(app)

    from sglang.launch_server import run_server
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import kill_process_tree

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )
    logger = logging.getLogger(__name__)
    logger.info("sgl_sparse: method=%s config=%s base=%s", hand.method, hand.config, hand.base)
    if hand.prefill_cuda_graph_off:
        logger.info("sgl_sparse: prefill CUDA graph disabled: %s", hand.prefill_cuda_graph_off)
    server_args = ServerArgs.from_cli_args(args)
    chunk, page = server_args.chunked_prefill_size, server_args.page_size
    if chunk and chunk > 0 and page and chunk % page:
        # SGLang's default chunk (a power of two) in whole pages of a method's page size (DeltaKV's 10): the flag
        # was not given (parse_args refuses a given one that does not divide).
        server_args.chunked_prefill_size = max(page, chunk - chunk % page)
        logger.info("sgl_sparse: --chunked-prefill-size %d (SGLang's default %d in whole pages of %d)",
                    server_args.chunked_prefill_size, chunk, page)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
