"""The socket a server listens on, reserved by whoever starts it.

A parent that starts a server binds its port first (`tessel.ports.reserve_port`: nothing can take
it while the server loads its model), passes the bound socket to the child as an inherited file
descriptor (`tessel serve --listen-fd`), and the child listens on it. Systemd socket activation
works the same way.
"""

from __future__ import annotations

import socket
from typing import Any

from tessel.errors import TesselError
from tessel.ports import port_of


def inherited_socket(fd: int) -> socket.socket:
    """The bound TCP socket at file descriptor `fd`, or a clear error naming what is there."""
    try:
        sock = socket.socket(fileno=fd)
    except (OSError, OverflowError, ValueError) as error:
        cause = getattr(error, "strerror", None) or error
        raise TesselError(f"--listen-fd {fd}: not an open socket ({cause})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise TesselError(f"--listen-fd {fd}: not a TCP socket")
    if port_of(sock) == 0:
        sock.detach()
        raise TesselError(f"--listen-fd {fd}: not bound to a port (the parent binds it before passing it)")
    return sock


def listen_address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return str(host), int(port)


def run_server(server: Any, listener: socket.socket | None) -> None:
    """Run a uvicorn `server` on its configured host and port, or on `listener` (inherited)."""
    if listener is None:
        server.run()
    else:
        server.run(sockets=[listener])


__all__ = ["inherited_socket", "listen_address", "run_server"]
