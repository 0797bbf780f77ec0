"""ServerProcess's port handling: two servers never share a port, and a busy port is refused before
anything starts (a shared port let one server's health check be answered by another)."""

from __future__ import annotations

import socket

import pytest

from sgl_sparse.server_process import ServerProcess, free_port


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
