"""ServerProcess's port handling: two servers never share a port, and a busy port is refused before
anything starts (a shared port let one server's health check be answered by another). A client ended
by SIGTERM stops its servers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sgl_sparse.server_process import RouterProcess, ServerProcess, _listening, free_port


def test_free_port_never_repeats() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_busy_port_is_refused_before_starting(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        srv = ServerProcess("no-such-model", port=port, log_path=str(tmp_path / "log"))
        with pytest.raises(RuntimeError, match=f"port {port} is already in use"):
            srv.start()
        assert srv.proc is None


def test_free_ports_lie_below_the_ephemeral_range() -> None:
    """A port from bind(0) is ephemeral: while a server loads, before it binds, another process's
    connection or gloo listener could take it (CI: uvicorn's EADDRINUSE, then a 10-minute hang)."""
    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    if lo - 20000 < 1000 and 65535 - hi < 1000:
        pytest.skip(f"the ephemeral range {lo}-{hi} leaves no room outside it")
    assert all(not lo <= p <= hi for p in (free_port() for _ in range(50)))


# A stand-in for a server module: the first port it is given is "taken" (it prints uvicorn's bind
# error and stays alive, as uvicorn does while its workers wind down); on any other it serves /health.
FAKE_SERVER = """
import http.server, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
first = open(sys.argv[0] + ".first", "a+")
first.seek(0)
if not first.read():
    first.write(str(port)); first.flush()
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str) -> dict[str, str]:
    """Write a stand-in server module into ``tmp_path``; the env that lets ``python -m module`` find it."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_a_port_taken_while_starting_moves_the_server(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    env = _stand_in(tmp_path, monkeypatch, "fake_server", FAKE_SERVER)
    srv = ServerProcess("m", module="fake_server", env=env, startup_timeout=30, log_path=str(tmp_path / "log"))
    first = srv.port
    t0 = time.monotonic()
    with srv:
        assert srv.port != first and srv.base_url.endswith(f":{srv.port}")
        assert srv.cmd[srv.cmd.index("--port") + 1] == str(srv.port)
        assert _listening(srv.port)
    assert time.monotonic() - t0 < 20  # not the whole startup timeout
    assert (tmp_path / "fake_server.py.first").read_text() == str(first)

    # A port the caller chose is not moved: the error says what happened.
    (tmp_path / "fake_server.py.first").unlink()
    fixed = ServerProcess("m", module="fake_server", port=free_port(), env=env, startup_timeout=30,
                          log_path=str(tmp_path / "log2"))
    with pytest.raises(RuntimeError, match=f"port {fixed.port} was taken while the server started"):
        fixed.start()
    assert fixed.proc is not None and fixed.proc.poll() is not None  # stopped, not left running


# A server whose /health answers after 4 s, as SGLang's does when a forward is slow (it waits for the
# one-token request it sends; a loaded CI machine under TRITON_INTERPRET=1 took over 2 s).
SLOW_HEALTH_SERVER = """
import http.server, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(4); self.send_response(200); self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_a_slow_health_answer_is_waited_for(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    env = _stand_in(tmp_path, monkeypatch, "slow_server", SLOW_HEALTH_SERVER)
    with ServerProcess("m", module="slow_server", env=env, startup_timeout=20, log_path=str(tmp_path / "log")) as srv:
        assert _listening(srv.port)


def test_router_process_command() -> None:
    """Each router gets its own port and Prometheus port (two routers on one host would both take 29000)."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    a, b = RouterProcess(urls, args=["--log-level", "warn"]), RouterProcess(urls)
    assert a.cmd[1:3] == ["-m", "smg.launch_router"]
    i = a.cmd.index("--worker-urls")
    assert a.cmd[i + 1:i + 3] == urls and a.cmd[a.cmd.index("--policy") + 1] == "cache_aware"
    assert a.cmd[-2:] == ["--log-level", "warn"] and a.health_path == "/readiness"
    ports = {int(c[c.index(flag) + 1]) for c in (a.cmd, b.cmd) for flag in ("--port", "--prometheus-port")}
    assert len(ports) == 4


def _running_in_group(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (a zombie is done; reaping it is init's job)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
        except OSError:
            continue  # it ended meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


CLIENT = """
import sys, time
from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
with ServerProcess(sys.argv[1], CPU_SERVER_FLAGS, port=int(sys.argv[2]), log_path=sys.argv[3]) as srv:
    print(srv.proc.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.server
def test_sigterm_to_the_client_stops_its_server(tiny_model: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The real server runs in its own session; `kill CLIENT` (what a batch system or timeout sends)
    must not leave it running on its port."""
    port = free_port()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, tiny_model, str(port), str(tmp_path / "log")],
                              stdout=subprocess.PIPE, text=True)
    server_pid = 0
    try:
        assert client.stdout is not None
        server_pid = int(client.stdout.readline())  # printed once the server is healthy
        assert _listening(port)
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(port)
        assert _running_in_group(server_pid) == []  # nor any of its children (scheduler, detokenizer)
    finally:
        client.kill()
        if server_pid and _running_in_group(server_pid):  # the bug this tests: do not leak the server
            os.killpg(server_pid, signal.SIGKILL)
