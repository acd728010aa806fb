"""Request bodies that never finish (issue 27): a `Content-Length` larger than what is sent, or a
chunked body trickled for ever, held a connection 60-90 s and more with no read timeout. Now a body
not in full within `body_timeout_s` of the headers gets 408 naming the limit and the connection is
closed. Raw sockets against uvicorn on 127.0.0.1 (a free port, in a thread), with a short timeout;
a body that is complete is never timed, however long its answer takes.
"""

from __future__ import annotations

import json
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

BODY_TIMEOUT_S = 1.0  # short, so the test is quick; a healthy client sends its body at once
DEADLINE_S = 30.0  # any socket wait: far above BODY_TIMEOUT_S, far below the 60-90 s of the finding
TRICKLE_S = 0.2  # a chunked client sends one byte this often: always "still sending"


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Any:
    from tessel.engine.llm_engine import LLMEngine

    return LLMEngine(str(tiny_model), max_num_seqs=4, max_model_len=128, kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def app(engine: Any) -> Any:
    from tessel.server.app import create_app
    from tessel.server.limits import ServerLimits

    return create_app(engine, max_pending=8, limits=ServerLimits(body_timeout_s=BODY_TIMEOUT_S))


@pytest.fixture(scope="module")
def address(app: Any, serve_in_thread: Any) -> tuple[str, int]:
    with serve_in_thread(app) as url:
        host, port = url.removeprefix("http://").split(":")
        assert host == "127.0.0.1"  # loopback only
        yield host, int(port)


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=DEADLINE_S)
    return sock


def _headers(address: tuple[str, int], *lines: str) -> bytes:
    head = ["POST /v1/completions HTTP/1.1", f"Host: {address[0]}:{address[1]}"]
    head += ["Content-Type: application/json", *lines]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails after DEADLINE_S)."""
    data = b""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server kept the connection open; it sent {data[:200]!r}")


def _check_408(response: bytes) -> None:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 408 Request Timeout", lines
    assert "connection: close" in [line.lower() for line in lines[1:]], lines
    error = json.loads(body)["error"]
    assert "body_timeout_s" in error["message"] and f"{BODY_TIMEOUT_S:g} s" in error["message"], error


def test_a_content_length_larger_than_the_body_gets_408_and_a_close(address: tuple[str, int]) -> None:
    with _connect(address) as sock:
        sock.sendall(_headers(address, "Content-Length: 100") + b'{"prompt": "hi"}')  # 16 of 100 bytes
        _check_408(_read_until_closed(sock))


def test_a_chunked_body_trickled_for_ever_gets_408_and_a_close(address: tuple[str, int]) -> None:
    with _connect(address) as sock:
        sock.sendall(_headers(address, "Transfer-Encoding: chunked") + b"1\r\n{\r\n")
        # Trickle until just before the server's deadline, then only wait: a byte that reaches the server
        # after it answered stays unread when it closes, and the kernel then resets the connection,
        # which can discard the 408 before this client reads it.
        last_send = time.monotonic() + BODY_TIMEOUT_S - TRICKLE_S
        end = time.monotonic() + DEADLINE_S
        while not select.select([sock], [], [], TRICKLE_S)[0]:  # until the server answers
            assert time.monotonic() < end, "the server never answered a trickled body"
            if time.monotonic() < last_send:
                sock.sendall(b"1\r\n \r\n")
        _check_408(_read_until_closed(sock))


def test_headers_without_a_body_get_408(address: tuple[str, int]) -> None:
    with _connect(address) as sock:
        sock.sendall(_headers(address, "Content-Length: 20"))
        _check_408(_read_until_closed(sock))


def test_complete_bodies_are_never_timed(
    address: tuple[str, int], app: Any, engine: Any, engine_paused: Any, wait_until: Any
) -> None:
    """A body sent in two parts within the limit is served; a request whose answer takes longer
    than body_timeout_s (the engine held) is not cut: only the body's arrival is timed."""
    with _connect(address) as sock:
        body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
        sock.sendall(_headers(address, f"Content-Length: {len(body)}", "Connection: close") + body[:5])
        sock.sendall(body[5:])
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 200 OK")
    url = f"http://{address[0]}:{address[1]}/v1/completions"
    with ThreadPoolExecutor(1) as pool:
        with engine_paused(app.state.async_engine):
            answer = pool.submit(httpx.post, url, json={"prompt": "hi", "max_tokens": 2}, timeout=DEADLINE_S)
            wait_until(lambda: app.state.async_engine.num_pending == 1, "the request to be held")
            held = time.monotonic()
            wait_until(lambda: time.monotonic() > held + 2 * BODY_TIMEOUT_S, "twice the body timeout")
            assert not answer.done()  # its body was read; it waits for the held engine
        assert answer.result(timeout=DEADLINE_S).status_code == 200
    wait_until(lambda: not engine.has_unfinished_requests(), "the engine to finish")
