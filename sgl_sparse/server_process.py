"""Start and stop a real SGLang server process (ours or vanilla) for tests, the demo and benchmarks.

Only subprocess + HTTP: no SGLang imports, so it works from any client environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

# Measured for SGLang 0.5.17 on a CPU-only host (docs/cpu.md says why each is needed).
CPU_SERVER_FLAGS = [
    "--device", "cpu",
    "--sampling-backend", "pytorch",
    "--max-total-tokens", "16384",
    "--sleep-on-idle",
    "--grammar-backend", "llguidance",
    "--dtype", "float32",
]
# The stock launcher needs these to match what ours selects on CPU (ours sets the page size each method
# needs, and runs SGLang's paged allocator in torch there).
VANILLA_CPU_FLAGS = ["--attention-backend", "torch_native", "--disable-cuda-graph", "--page-size", "1"]
# Known-good flags on a GPU (the piecewise prefill CUDA graph would add over a minute of start-up and is
# off for SnapKV anyway). Ours picks its attention backend itself (FlashInfer on CUDA); a vanilla server
# gets `--attention-backend flashinfer` from its caller.
GPU_SERVER_FLAGS = ["--sampling-backend", "pytorch", "--disable-piecewise-cuda-graph",
                    "--chunked-prefill-size", "16384"]


log = logging.getLogger(__name__)
HEALTH_POLL_S = 0.25  # between /health tries while a server starts (a start takes 20-60 s on CPU)
GRACEFUL_STOP_S = 30.0  # SGLang's own exit (children joined, ports released) takes 7-9 s on CPU

_HANDED_OUT: set[int] = set()
_PORT_LOCK = threading.Lock()
_PORT_FLOOR = 20000  # below: well-known and registered services


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_range() -> tuple[int, int]:
    """Where :func:`free_port` draws: below the ephemeral range, else above it; ``(0, 0)`` when neither leaves
    1,000 ports (the kernel's ``bind(0)`` then)."""
    lo, hi = _ephemeral_range()
    if lo - _PORT_FLOOR >= 1000:
        return _PORT_FLOOR, lo
    if 65536 - (hi + 1) >= 1000:
        return hi + 1, 65536
    return 0, 0


def free_port() -> int:
    """A free port, never the same one twice in this process: servers constructed together and started
    later must not share a port, or one's health check would be answered by the other (seen in CI).

    Chosen outside the kernel's ephemeral range: a server binds its HTTP port only once it has loaded
    (tens of seconds on CPU), and in that window an ephemeral port handed back by ``bind(0)`` can be
    taken by anything that binds or connects (another server's gloo/TCPStore, SGLang's own
    ``get_free_port``, clients); CI saw uvicorn fail with EADDRINUSE that way, then hang."""
    lo, hi = _port_range()
    rng = random.Random()  # unseeded: parallel test processes draw different ports
    with _PORT_LOCK:  # running() starts servers from threads, and a taken port draws a new one there
        for _ in range(1000):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", rng.randrange(lo, hi) if hi else 0))
                except OSError:
                    continue
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError(f"no free port in [{lo}, {hi})")


class _PortTaken(Exception):
    """The server could not bind its port: something else took it between choosing and binding."""


_BIND_FAILED = b"error while attempting to bind on address"  # uvicorn's words for EADDRINUSE and the like
_LIVE: set[ServerProcess] = set()  # started, not yet stopped


def _stop_live_servers_and_exit(signum: int, frame: object) -> None:
    stop_all(list(_LIVE))
    raise SystemExit(128 + signum)


def stop_servers_on_sigterm() -> None:
    """Servers run in their own session (so that stop() can end their whole process group), hence a
    SIGTERM to this process alone would leave them running, holding ports and GPU memory, since its
    default action skips every ``with``/``finally``. Stop them first, then exit. Installed only from
    the main thread and only over the default action: a handler already set (pytest's, the caller's)
    stays."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_live_servers_and_exit)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


class ServerProcess:
    """A server started as ``python -m <module> --model-path M --port P <args>``.

    ``module`` is ``sgl_sparse.launch_server`` (ours) or ``sglang.launch_server`` (vanilla). Output
    goes to a log file whose tail is shown if the server fails to come up. Use as a context manager.
    """

    health_path = "/health"  # answered 200 once the process can serve

    def __init__(
        self,
        model_path: str,
        args: Sequence[str] = (),
        module: str = "sgl_sparse.launch_server",
        port: int | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 300.0,
        log_path: str | None = None,
    ) -> None:
        self._port_chosen_here = port is None  # only then may start() move to another port
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", module, "--model-path", model_path,
                    "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="sglang-server-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None  # seconds from launch to healthy (the last try's)
        self.stop_s: float | None = None  # seconds from the first signal to exit

    def start(self) -> ServerProcess:
        for attempt in range(3):
            try:
                t0 = time.monotonic()
                self._start_once()
                self.start_s = time.monotonic() - t0
                log.info("server on port %d healthy after %.1f s: %s", self.port, self.start_s, self.label())
                return self
            except _PortTaken:
                self.stop()
                if not self._port_chosen_here or attempt == 2:
                    raise RuntimeError(f"port {self.port} was taken while the server started:\n"
                                       f"{self.log_tail()}") from None
                self._move_to(free_port())
        raise AssertionError("unreachable")

    def _move_to(self, port: int) -> None:
        self.cmd[self.cmd.index("--port") + 1] = str(port)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    def _bind_failed(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                return _BIND_FAILED in f.read()
        except OSError:
            return False

    def _start_once(self) -> ServerProcess:
        if _listening(self.port):  # else the health check below would be answered by that other server
            if self._port_chosen_here:
                raise _PortTaken
            raise RuntimeError(f"port {self.port} is already in use; pick another (or none: a free one is chosen)")
        log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self._log = log
        stop_servers_on_sigterm()
        self.proc = self._launch(log)
        _LIVE.add(self)
        deadline = time.monotonic() + self.startup_timeout
        health_wait = float(self.env.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20)) + 10.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._bind_failed():
                    raise _PortTaken
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            # SGLang's /health generates one token and answers once a forward has returned (up to its
            # SGLANG_HEALTH_CHECK_TIMEOUT, 20 s): a client that gives up sooner never sees a slow server
            # (a loaded CI machine, TRITON_INTERPRET=1) healthy, and each retry queues one more request.
            wait = max(1.0, min(health_wait, deadline - time.monotonic()))
            try:
                if requests.get(f"{self.base_url}{self.health_path}", timeout=wait).status_code == 200:
                    if self._bind_failed():  # answered by whoever holds the port, not by this server
                        raise _PortTaken
                    return self
            except requests.RequestException:
                # uvicorn logs a failed bind and then waits, alive, for its workers: without this
                # check the wait would last the whole startup timeout.
                if self._bind_failed():
                    raise _PortTaken from None
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout}s:\n{self.log_tail()}")

    def _launch(self, log: Any) -> Any:
        """The server's process, leader of its own session (``stop`` ends the whole group): a ``Popen``, or an
        object with its ``pid``, ``poll()``, ``wait(timeout)`` and ``returncode``."""
        return subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def label(self) -> str:
        """The command without the interpreter, model directory and port: what tells servers apart in a log."""
        args = self.cmd[2:]
        for flag in ("--model-path", "--host", "--port"):
            if flag in args:
                i = args.index(flag)
                args = [*args[:i], *args[i + 2:]]
        return " ".join([self.cmd[2], *args[1:]])

    def signal_stop(self) -> None:
        """Send SIGTERM to the server's process group (its scheduler and detokenizer are children) and return."""
        _LIVE.discard(self)
        if self.proc is not None and self.proc.poll() is None:
            self._stop_t0: float | None = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def wait_stopped(self, grace: float = GRACEFUL_STOP_S) -> None:
        """Wait up to ``grace`` seconds for the exit :meth:`signal_stop` asked for, then kill the group."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=max(0.0, grace))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            # Children left behind by a leader that exited first (a killed launcher's scheduler).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            t0 = getattr(self, "_stop_t0", None)
            if t0 is not None:
                self.stop_s = time.monotonic() - t0
                self._stop_t0 = None
                log.info("server on port %d stopped in %.1f s: %s", self.port, self.stop_s, self.label())
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def stop(self, grace: float = GRACEFUL_STOP_S) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds. The default lets SGLang exit on its own (the demo,
        benchmarks and the CLI); test servers use a short grace (:func:`stop_all`)."""
        self.signal_stop()
        self.wait_stopped(grace)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- small client helpers ------------------------------------------------------------------
    def generate(self, text: str | None = None, input_ids: list[int] | None = None, timeout: float = 300.0,
                 **sampling: Any) -> dict:
        body: dict[str, Any] = {"sampling_params": {"temperature": 0.0, **sampling}}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = text
        r = requests.post(f"{self.base_url}/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def server_info(self) -> dict:
        r = requests.get(f"{self.base_url}/server_info", timeout=30)
        r.raise_for_status()
        return r.json()


class RouterProcess(ServerProcess):
    """``python -m smg.launch_router`` (the ``smg`` package, SGLang's gateway) in front of running
    workers, on ``127.0.0.1``. Healthy once ``/readiness`` answers 200 and the router has registered
    every worker in ``worker_urls`` and polled its load. It adds the workers in the background after it
    starts, and polls one that registers after its load monitor's first tick only a
    ``--load-monitor-interval`` later (10 s by default). Until then smg 1.13.0's ``cache_aware`` miss path
    (least expected wait) scores that worker equal to the polled ones and breaks the tie at random, so
    new conversations sent at once may all land on one worker.
    Its Prometheus exporter gets a free port of its own (the default 29000 would collide between
    routers); ``args`` are more router flags."""

    health_path = "/readiness"

    def __init__(self, worker_urls: Sequence[str], policy: str = "cache_aware", args: Sequence[str] = (),
                 port: int | None = None, env: dict[str, str] | None = None, startup_timeout: float = 120.0,
                 log_path: str | None = None) -> None:
        super().__init__("", (), module="smg.launch_router", port=port, env=env,
                         startup_timeout=startup_timeout,
                         log_path=log_path or tempfile.mkstemp(prefix="smg-", suffix=".log")[1])
        self.worker_urls = list(worker_urls)
        self.cmd = [sys.executable, "-m", "smg.launch_router", "--host", "127.0.0.1",
                    "--port", str(self.port), "--worker-urls", *self.worker_urls, "--policy", policy,
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *args]

    def start(self) -> RouterProcess:
        super().start()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            polled = self.workers(polled=True)
            if all(url in polled for url in self.worker_urls):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"router lists {self.workers()} and has polled the load of {polled}, "
                                   f"not of all of {self.worker_urls}:\n{self.log_tail()}")
            time.sleep(0.5)

    def workers(self, polled: bool = False) -> list[str]:
        """The URLs of the workers the router has registered (``GET /workers``); ``polled``: only those whose
        load it has polled (their ``engine_load``)."""
        r = requests.get(f"{self.base_url}/workers", timeout=10)
        r.raise_for_status()
        body = r.json()
        listed = body.get("workers", []) if isinstance(body, dict) else body
        return [w.get("url", "") if isinstance(w, dict) else str(w) for w in listed
                if not polled or (isinstance(w, dict) and w.get("engine_load"))]

    def server_info(self) -> dict:
        raise NotImplementedError("ask each worker: the router has no /server_info of its own")


def stop_all(servers: Sequence[ServerProcess], grace: float = GRACEFUL_STOP_S) -> None:
    """Stop ``servers`` together: every one is signalled first, then each gets what is left of one ``grace``."""
    for s in servers:
        s.signal_stop()
    deadline = time.monotonic() + grace
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(lambda s: s.wait_stopped(deadline - time.monotonic()), servers))


@contextlib.contextmanager
def running(*servers: ServerProcess, grace: float = GRACEFUL_STOP_S) -> Iterator[tuple[ServerProcess, ...]]:
    """Start ``servers`` in parallel (startup is mostly waiting), stop them all together on exit or failure."""
    stop_servers_on_sigterm()  # here, in the caller's thread: start() runs in pool threads
    try:
        with ThreadPoolExecutor(max(1, len(servers))) as pool:
            for f in [pool.submit(s.start) for s in servers]:
                f.result()
        yield servers
    finally:
        stop_all(servers, grace)
