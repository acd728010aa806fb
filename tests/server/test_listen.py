"""A server's port is bound by whoever starts it and inherited: nothing takes it while the server loads."""

from __future__ import annotations

import errno
import socket
import sys
from pathlib import Path

import pytest

from tessel.ports import port_of, reserve_port
from tessel.server import replica_backends
from tessel.server.listen import inherited_socket, listen_address
from tessel.server.replica_backends import ReplicaSpec, spawn_backend, stop_backends, wait_ready

DEADLINE_S = 60.0

# A stand-in replica server: waits for the test's go-ahead file, then serves /health on the socket
# its parent bound (--listen-fd), as `tessel serve` does once its model has loaded.
STAND_IN = """
import http.server, pathlib, socket, sys, time
argv = sys.argv
fd, go = int(argv[argv.index("--listen-fd") + 1]), pathlib.Path(argv[argv.index("--go") + 1])
while not go.exists():
    time.sleep(0.01)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"data": [{"max_model_len": 64}]}'
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
server = http.server.HTTPServer(("127.0.0.1", 0), Health, bind_and_activate=False)
server.socket.close()
server.socket = socket.socket(fileno=fd)
server.server_activate()
server.serve_forever()
"""


def test_a_reserved_port_is_held_but_refuses_connections() -> None:
    with reserve_port() as held:
        port = port_of(held)
        assert port > 0 and held.get_inheritable()
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", port))  # not listening yet: refused, never left waiting


def test_the_inherited_socket_is_the_reserved_one() -> None:
    with reserve_port() as held:
        duplicate = inherited_socket(held.dup().detach())
        try:
            assert listen_address(duplicate) == ("127.0.0.1", port_of(held))
        finally:
            duplicate.close()


def test_a_replica_server_port_stays_held_while_it_starts(tmp_path: Path, monkeypatch) -> None:
    """Between the spawn and the server's listen (a model loading), no one else can bind its port;
    then the server answers on exactly that port."""
    go = tmp_path / "go"

    def stand_in_argv(model: Path, plan: Path, replica: int, options: list[str]) -> list[str]:
        return [sys.executable, "-c", STAND_IN, "--go", str(go)]

    monkeypatch.setattr(replica_backends, "backend_argv", stand_in_argv)
    backend = spawn_backend(ReplicaSpec(0, 1.0), tmp_path / "model", tmp_path / "plan.json", [], tmp_path)
    try:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", backend.port))
        assert taken.value.errno == errno.EADDRINUSE
        assert backend.exit_cause() is None
        go.touch()
        wait_ready([backend], DEADLINE_S)  # /health, then /v1/models, on the port reserved at spawn
    finally:
        stop_backends([backend])
    assert backend.max_model_len == 64
