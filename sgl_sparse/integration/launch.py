"""``python -m sgl_sparse.launch_server``: every ``sglang.launch_server`` flag plus ours.

Validates ``--sparse-method``/``--sparse-config`` with argparse errors before anything heavy runs,
selects our radix-cache and attention backends, hands the config to the scheduler processes through
the environment (:mod:`.handoff`) and then runs SGLang's own ``run_server``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from sgl_sparse.errors import SparseConfigError
from sgl_sparse.integration import BACKEND_NAME, handoff
from sgl_sparse.registry import create_method, registered_methods

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
        help=f"KV-cache method. Registered: {', '.join(registered_methods())}. Default: dense.",
    )
    group.add_argument(
        "--sparse-config",
        default=None,
        metavar="JSON|PATH",
        help="The method's config fields as a JSON object, or a path to a JSON file. "
        "Unset fields keep the method's defaults.",
    )
    return parser


def _resolve_device(args: argparse.Namespace) -> str:
    if args.device is not None:
        return str(args.device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, handoff.Handoff]:
    """Parse and validate; exits with an argparse error (status 2) on bad input."""
    parser = build_parser()
    if "--config" in argv:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger

        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    args = parser.parse_args(argv)
    try:
        method = create_method(args.sparse_method, args.sparse_config)
    except SparseConfigError as e:
        parser.error(str(e))
    for flag, value in (("--attention-backend", args.attention_backend),
                        ("--radix-cache-backend", args.radix_cache_backend)):
        if value not in (None, BACKEND_NAME):
            parser.error(f"{flag} {value}: sgl_sparse serves through its own backend '{BACKEND_NAME}'; "
                         f"drop the flag (use `python -m sglang.launch_server` for stock SGLang)")
    if args.page_size not in (None, 1):
        parser.error(f"--page-size {args.page_size}: sgl_sparse supports page size 1 only (for now)")
    device = _resolve_device(args)
    for problem in unsupported_combinations(args, method, device, argv):
        parser.error(problem)
    if device == "cpu" and "--disable-cuda-graph" not in argv:
        # A backend name other than torch_native keeps CUDA graphs on, which cannot run on CPU.
        args = parser.parse_args([*argv, "--disable-cuda-graph"])
    args.attention_backend = BACKEND_NAME
    args.radix_cache_backend = BACKEND_NAME
    args.page_size = 1
    return args, handoff.Handoff(method.name, method.config.to_dict(), device)


def unsupported_combinations(args: argparse.Namespace, method: Any, device: str, argv: list[str]) -> list[str]:
    """What sgl_sparse cannot serve yet, as messages for argparse errors."""
    problems = []
    if args.enable_hierarchical_cache:
        problems.append("--enable-hierarchical-cache: HiCache is not supported with sgl_sparse yet")
    if args.enable_session_radix_cache or args.enable_streaming_session:
        problems.append("session radix caches / streaming sessions are not supported with sgl_sparse yet")
    if method.evicts:
        if args.speculative_algorithm:
            problems.append(f"--speculative-algorithm with {method.name}: speculative decoding is not supported "
                            "with eviction methods yet")
        if (args.tp_size or 1) > 1:
            problems.append(f"--tp-size {args.tp_size} with {method.name}: eviction needs one token set across "
                            "TP ranks, which is not implemented yet (use --dp-size for more GPUs)")
    decode_capture = method.observation_window() > 0 and method.observes_decode()
    if decode_capture and device != "cpu" and "--disable-cuda-graph" not in argv:
        problems.append(f"{method.name} with decode_interval > 0 collects decode queries in Python, which CUDA "
                        "graphs would skip: add --disable-cuda-graph (or set decode_interval to 0)")
    return problems


def main(argv: list[str] | None = None) -> None:
    from sglang.srt.plugins import load_plugins

    from sgl_sparse.integration.plugin import check_registered

    argv = sys.argv[1:] if argv is None else argv
    load_plugins()
    check_registered()
    args, hand = parse_args(argv)
    handoff.publish(hand)  # before ServerArgs: its __post_init__ and the spawned children read it

    from sglang.launch_server import run_server
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import kill_process_tree

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )
    logging.getLogger(__name__).info("sgl_sparse: method=%s config=%s", hand.method, hand.config)
    server_args = ServerArgs.from_cli_args(args)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
