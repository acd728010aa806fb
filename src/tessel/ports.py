"""Ports bound now and handed on later, so nothing takes them in between.

Choosing a free port by binding and closing it, then handing the number on, leaves the port open to
anyone until its user binds it, seconds later once a model has loaded: meanwhile an outgoing
connection (a health probe, a process group's link) or another process's listener can take it, and
the server or store dies with "address already in use". `reserve_port` keeps the port bound (not
listening: a connection is refused, never left waiting) until it is handed on as a file
descriptor: to a child server (`tessel.server.listen`, `--listen-fd`) or to the process group's
store (`tessel.pipeline.comm.group`).
"""

from __future__ import annotations

import socket


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a free port of `host`, not listening, inheritable by a child process."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def port_of(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def inherited(fd: int) -> socket.socket:
    """The socket a parent passed down as file descriptor `fd`."""
    return socket.socket(fileno=fd)


__all__ = ["inherited", "port_of", "reserve_port"]
