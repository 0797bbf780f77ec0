"""One pool of real SGLang servers for the whole test session (see tests/README.md).

A server is keyed by what makes it different: model, launcher module, flags (as a set of flag groups, so their
order does not matter) and environment. A test asks the pool for servers by :class:`Spec`; a server with that key
already running is handed out again, else it starts (several at once in parallel). The pool caps the servers it
keeps alive by memory (a CPU server holds ~2.5-3.5 GB): past the cap it stops the least recently used server that
no test holds. Servers stop together, with a short grace then SIGKILL: leak checks run inside the tests, never at
shutdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess, stop_all, stop_servers_on_sigterm
from tests.server_zygote import Zygote, ZygoteServer, eligible

# Pooled servers fork SGLang's scheduler and detokenizer from the launcher (SGLang spawns them: each re-imports
# SGLang, ~11 s of CPU); a spec that sets SGLSPARSE_MP_START itself keeps its choice (the session's dense and
# vanilla servers spawn, as in production).
FORKED_CHILDREN = {"SGLSPARSE_MP_START": "fork"}  # also for drivers that start servers of their own in tests
TEST_STOP_GRACE_S = 2.0  # then SIGKILL to the process group: nothing is checked at a test server's exit
DEFAULT_MAX_LIVE = 6  # tiny-model CPU servers alive at once (weights: a --tp-size 2 server counts 2)

# History turns start with "<s>role: ", the generation prompt is a bare "assistant:" (as the benchmark model's
# template): a next turn leaves the previous prompt two tokens before its end.
PREFIXED_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _flag_groups(args: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """``args`` as flag groups (a ``--flag`` and the values after it), sorted: the same server whatever the order.
    A flag given twice keeps its last values, as argparse does (``--max-total-tokens`` over the CPU default)."""
    groups: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    last = {g[0]: tuple(g) for g in groups}
    return tuple(sorted(last.values()))


@dataclass(frozen=True)
class Spec:
    """What a test needs of a server; equal specs share one server."""

    model: str
    args: tuple[tuple[str, ...], ...]
    module: str = "sgl_sparse.launch_server"
    env: tuple[tuple[str, str], ...] = ()
    startup_timeout: float = field(default=900.0, compare=False)
    replica: int = 0  # tells apart servers that must be separate though alike (a router's workers)

    @property
    def weight(self) -> int:
        """Processes that hold a model: one per TP x DP rank."""
        flat = dict((g[0], g[1]) for g in self.args if len(g) == 2)
        return int(flat.get("--tp-size", 1)) * int(flat.get("--dp-size", 1))

    def build(self, zygote: Zygote | None = None) -> ServerProcess:
        """The server, its launcher forked by ``zygote`` where its environment allows (tests/server_zygote.py)."""
        args = [a for g in self.args for a in g]
        env = {**FORKED_CHILDREN, **dict(self.env)}
        if zygote is not None and eligible(self.module, env):
            return ZygoteServer(zygote, self.model, args, module=self.module, env=env,
                                startup_timeout=self.startup_timeout)
        return ServerProcess(self.model, args, module=self.module, env=env, startup_timeout=self.startup_timeout)


def spec(model: str, args: Sequence[str] = (), module: str = "sgl_sparse.launch_server",
         env: dict[str, str] | None = None, startup_timeout: float = 900.0, replica: int = 0) -> Spec:
    return Spec(str(model), _flag_groups(args), module, tuple(sorted((env or {}).items())), startup_timeout,
                replica)


@dataclass
class _Entry:
    server: ServerProcess
    weight: int
    holders: int = 0
    last_used: float = 0.0


class ServerPool:
    """Session-wide servers by :class:`Spec`; see the module docstring."""

    def __init__(self, max_live: int = DEFAULT_MAX_LIVE, record_path: str | None = None,
                 zygote: bool = True) -> None:
        self.max_live = max_live
        self.record_path = record_path
        self.zygote = Zygote() if zygote else None
        self._entries: dict[Spec, _Entry] = {}
        self._lock = threading.Lock()

    def _live_weight(self) -> int:
        return sum(e.weight for e in self._entries.values())

    def _make_room(self, weight: int, keep: set[Spec]) -> None:
        """Stop idle servers but ``keep``, least recently used first, until ``weight`` more fit under the cap (or
        none is left: then the held servers and the new ones run together above it)."""
        idle = sorted((k for k, e in self._entries.items() if e.holders == 0 and k not in keep),
                      key=lambda k: self._entries[k].last_used)
        victims: list[Spec] = []
        while idle and self._live_weight() - sum(self._entries[k].weight for k in victims) + weight > self.max_live:
            victims.append(idle.pop(0))
        self._stop([self._entries.pop(k).server for k in victims])

    def _stop(self, servers: list[ServerProcess]) -> None:
        if servers:
            stop_all(servers, TEST_STOP_GRACE_S)
            for s in servers:
                self._record("stop", s)

    def _record(self, event: str, srv: ServerProcess) -> None:
        if self.record_path is None:
            return
        seconds = srv.start_s if event == "start" else srv.stop_s
        label = srv.label()
        for flag in _flag_groups(CPU_SERVER_FLAGS):  # every CPU server's: not what tells them apart
            label = label.replace(" " + " ".join(flag), "")
        line = {"event": event, "server": label, "seconds": round(seconds or 0.0, 2), "at": time.time(),
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
        with open(self.record_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    @contextlib.contextmanager
    def use(self, *specs: Spec, once: bool = False) -> Iterator[tuple[ServerProcess, ...]]:
        """The servers of ``specs``, started if need be (those missing start together), held until the block
        ends: the pool never stops a held server. ``once``: no other test will ask for them (a configuration of
        one test's), so they stop when the block ends, leaving their memory to the next servers."""
        stop_servers_on_sigterm()  # in the caller's (main) thread: servers start in pool threads
        with self._lock:
            for s in specs:  # a server that died (a failed test's crash) starts again rather than fail every user
                e = self._entries.get(s)
                if e is not None and e.server.proc is not None and e.server.proc.poll() is not None:
                    assert e.holders == 0, f"a held server exited: {e.server.label()}\n{e.server.log_tail()}"
                    self._stop([self._entries.pop(s).server])
            missing = list(dict.fromkeys(s for s in specs if s not in self._entries))
            self._make_room(sum(s.weight for s in missing), set(specs))
            fresh = {s: s.build(self.zygote) for s in missing}
            try:
                with ThreadPoolExecutor(max(1, len(fresh))) as pool:
                    for f in [pool.submit(srv.start) for srv in fresh.values()]:
                        f.result()
            except BaseException:
                stop_all(list(fresh.values()), TEST_STOP_GRACE_S)
                raise
            for s, srv in fresh.items():
                self._entries[s] = _Entry(srv, s.weight)
                self._record("start", srv)
            held = [self._entries[s] for s in specs]
            for e in held:
                e.holders += 1
        try:
            yield tuple(e.server for e in held)
        finally:
            with self._lock:
                now = time.monotonic()
                for e in held:
                    e.holders -= 1
                    e.last_used = now
                if once:
                    done = [s for s in dict.fromkeys(specs) if self._entries[s].holders == 0]
                    self._stop([self._entries.pop(s).server for s in done])

    def close(self) -> None:
        with self._lock:
            servers = [e.server for e in self._entries.values()]
            self._entries.clear()
        self._stop(servers)
        if self.zygote is not None:
            self.zygote.close()


def state(server: ServerProcess) -> dict:
    """Our block of ``/server_info`` (the first scheduler's)."""
    return server.server_info()["internal_states"][0]["sgl_sparse"]


IDLE_POLL_S = 0.05


def wait_idle_checked(server: ServerProcess, timeout: float = 60.0, protected: bool = True) -> dict:
    """Wait until no request runs (and, with ``protected``, the tree protects no slot), then until SGLang's idle
    checks (strict pool leak check, request pool, tree) have run and passed after that: the server's
    ``idle_checks_passed_total`` moves past the count seen once idle. Returns the state read last."""
    deadline = time.monotonic() + timeout
    seen: int | None = None
    while True:
        st = state(server)
        idle = st["requests_tracked"] == 0 and (not protected or st["tree_protected_slots"] == 0)
        if not idle:
            seen = None
        elif seen is None:
            seen = st["idle_checks_passed_total"]
        elif st["idle_checks_passed_total"] > seen:
            return st
        assert time.monotonic() < deadline, f"server did not go idle, or its idle check did not pass: {st}"
        time.sleep(IDLE_POLL_S)


def assert_idle_and_sound(server: ServerProcess, timeout: float = 60.0) -> dict:
    """Wait until the server is idle and its idle leak check passed, then check the accounting SGLang's leak
    check relies on as we report it. Returns our state. (Not SGLang's ``/health``: it sleeps a second and runs a
    request of its own; the scheduler's answers to ``/server_info`` show it alive.)"""
    wait_idle_checked(server, timeout)
    st = state(server)
    assert st["kv_slots_used"] == st["tree_evictable_slots"] + st["tree_protected_slots"], st
    assert "pool memory leak" not in server.log_tail(400)
    return st


def fresh(server: ServerProcess) -> dict:
    """Empty ``server``'s prefix cache, for a test that needs a clean tree; its state once idle and leak-free.
    Idle first: SGLang refuses a flush (400) while any request runs, such as one a previous test's client gave up
    on and the scheduler still finishes."""
    wait_idle_checked(server)
    r = requests.post(f"{server.base_url}/flush_cache", timeout=30)
    assert r.status_code == 200, (r.status_code, r.text)
    return assert_idle_and_sound(server)
