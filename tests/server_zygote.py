"""Forked launchers for pooled test servers: one process imports SGLang once, then forks each server's launcher.

A CPU server start spends ~10 s of CPU importing SGLang in ``python -m sgl_sparse.launch_server`` before it parses
a flag. The zygote (a child of the test process) imports what our launcher's ``main`` imports, then waits for
requests on its stdin: each is one server (argv, environment, log file), for which it forks a child that becomes
the leader of a new session, points its stdio at the log, takes the environment, and runs
``sgl_sparse.launch_server`` as ``python -m`` would. What the launcher does from there is unchanged.

Only servers whose environment the zygote's imports do not read may come from here (:func:`eligible`,
:data:`FORKABLE_ENV`): a variable read at import time (``TRITON_INTERPRET``) would be read by the zygote, not by the
server.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sgl_sparse.server_process import ServerProcess

# Variables read after the zygote's imports (when the launcher or a scheduler runs, or by modules the zygote does
# not import), so a forked launcher may set them itself. Not TRITON_INTERPRET: Triton reads it on import.
FORKABLE_ENV = {"SGLSPARSE_MP_START", "SGLSPARSE_METHOD_MODULES", "SGLSPARSE_TP_CHECK", "SGLSPARSE_ATTENTION_IMPL",
                "SGLSPARSE_CHECK_TABLES", "SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_NCCL_SO_PATH", "PYTHONPATH"}
ROOT = Path(__file__).resolve().parents[1]
MODULE = "sgl_sparse.launch_server"

_SOURCE = r"""
import json, os, runpy, signal, sys

import sgl_sparse.integration.launch  # noqa: F401  (what main() imports, below: the ~10 s a start saves)
import sglang.launch_server  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.plugins  # noqa: F401
import sglang.srt.server_args  # noqa: F401


def reap(*_):
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


signal.signal(signal.SIGCHLD, reap)
out = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
print("ready", file=out, flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out.close()  # the zygote's answers are not the server's to hold open
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.environ.clear()
            os.environ.update(req["env"])
            sys.argv = [req["module"], *req["argv"]]
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, file=out, flush=True)
"""


def _zygote_path() -> list[str]:
    return [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def eligible(module: str, env: dict[str, str]) -> bool:
    """A server the zygote can fork: our launcher, and an environment it may set after the imports (a PYTHONPATH
    only of entries on the zygote's own path: ``sys.path`` is not read again)."""
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return module == MODULE and set(env) <= FORKABLE_ENV and all(p in _zygote_path() for p in path)


class ForkedProcess:
    """What :class:`ServerProcess` needs of a ``Popen`` for a process the zygote forked (and reaps)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                stat = Path(f"/proc/{self.pid}/stat").read_text()
            except OSError:
                self.returncode = -1  # reaped: its status went to the zygote
            else:
                if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        return code


class Zygote:
    """The forking process; :meth:`fork` is safe from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def _started(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(_zygote_path())}
            self._proc = subprocess.Popen([sys.executable, "-c", _SOURCE], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env)
            assert self._proc.stdout is not None
            line = self._proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"the server zygote did not start: {line!r}")
        return self._proc

    def fork(self, argv: list[str], env: dict[str, str], log_path: str) -> ForkedProcess:
        with self._lock:
            proc = self._started()
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps({"module": MODULE, "argv": argv, "env": env, "log": log_path}) + "\n")
            proc.stdin.flush()
            return ForkedProcess(int(proc.stdout.readline()))

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(OSError):
                    self._proc.kill()
                self._proc.wait(timeout=10)
            self._proc = None


class ZygoteServer(ServerProcess):
    """A :class:`ServerProcess` whose launcher the zygote forks instead of a ``python -m`` start."""

    def __init__(self, zygote: Zygote, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._zygote = zygote

    def _launch(self, log: Any) -> Any:
        return self._zygote.fork(self.cmd[3:], self.env, str(self.log_path))
