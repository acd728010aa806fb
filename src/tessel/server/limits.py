"""Limits that keep one client from starving the others: body size and read time, prompt size,
tokenizer threads.

`ServerLimits` holds them (the `tessel serve` options of the same names); `BodySizeLimit` is the
ASGI middleware that answers 413 to a body over `max_body_bytes`, from its Content-Length before
reading anything, or as soon as a chunked body grows past it; `BodyReadTimeout` answers 408 and
closes the connection when a body has not arrived in full `body_timeout_s` after the request's
headers (a Content-Length larger than what is sent, a chunked body trickled forever). Prompt limits
are checked by the routes: characters before tokenizing, tokens after. Starlette is imported only
where needed, so `tessel serve` reads the defaults without the runtime extra.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

from tessel.errors import TesselError

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # 8 MiB: two million 4-byte characters plus JSON overhead
DEFAULT_MAX_PROMPT_CHARS = 1_000_000  # about 250K tokens of English, above most models' context
DEFAULT_TOKENIZER_THREADS = 2  # a huge prompt tokenizing on one leaves the other to short ones
DEFAULT_MAX_ENGINE_RESTARTS = 3  # engine failures not pinned on a request before the server exits
# A whole request body within 30 s of its headers: 8 MiB (the body limit) at 2.2 Mbit/s; a client
# still sending after that is stuck or trickling on purpose, and holds a connection meanwhile.
DEFAULT_BODY_TIMEOUT_S = 30.0
MIN_BODY_TIMEOUT_S = 1e-3  # a millisecond: less is gone before any body could arrive
MAX_BODY_TIMEOUT_S = 24 * 3600.0  # a day: a connection held longer is held on purpose


@dataclass(slots=True)
class ServerLimits:
    """`max_prompt_tokens=None`: the engine's max_model_len is the only token limit."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_prompt_tokens: int | None = None
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS
    max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise TesselError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise TesselError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_engine_restarts < 0:
            raise TesselError(f"max_engine_restarts must be >= 0, got {self.max_engine_restarts}")
        if not (math.isfinite(self.body_timeout_s) and MIN_BODY_TIMEOUT_S <= self.body_timeout_s):
            raise TesselError(
                f"body_timeout_s must be a finite number of seconds >= {MIN_BODY_TIMEOUT_S:g}, "
                f"got {self.body_timeout_s}"
            )

    def check_prompt_chars(self, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise TesselError(
                f"the prompt has {num_chars} characters; this server accepts at most "
                f"{self.max_prompt_chars} (max_prompt_chars)"
            )

    def check_prompt_tokens(self, num_tokens: int) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise TesselError(
                f"the prompt has {num_tokens} tokens; this server accepts at most "
                f"{self.max_prompt_tokens} (max_prompt_tokens)"
            )


def _too_large(max_body_bytes: int) -> Exception:
    from starlette.exceptions import HTTPException

    return HTTPException(
        413, f"the request body is larger than this server's limit of {max_body_bytes} bytes (max_body_bytes)"
    )


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over `max_body_bytes`."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            from tessel.server.http_errors import response_for

            await response_for(_too_large(self.max_body_bytes))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _too_large(self.max_body_bytes)  # the route's body read answers 413
            return message

        await self.app(scope, limited_receive, send)


def _too_slow(body_timeout_s: float) -> Exception:
    from starlette.exceptions import HTTPException

    return HTTPException(
        408,
        f"the request body did not arrive in full within {body_timeout_s:g} s of its headers "
        "(body_timeout_s); the connection is closed",
    )


class BodyReadTimeout:
    """ASGI middleware: 408 with `Connection: close` for a body not received in full within
    `body_timeout_s` of the request's start. Only the body is timed: once it is complete, later
    receives (a route waiting for the client to disconnect) wait as long as they need."""

    def __init__(self, app: Any, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.body_timeout_s
        body_done = timed_out = False

        async def timed_receive() -> dict:
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                timed_out = True
                raise _too_slow(self.body_timeout_s) from None  # the route's body read answers 408
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def closing_send(message: dict) -> None:
            if timed_out and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)
