"""Limits that keep one client from starving the others: body size, prompt size, tokenizer threads.

`ServerLimits` holds them (the `tessel serve` options of the same names); `BodySizeLimit` is the
ASGI middleware that answers 413 to a body over `max_body_bytes`, from its Content-Length before
reading anything, or as soon as a chunked body grows past it. Prompt limits are checked by the
routes: characters before tokenizing, tokens after. Starlette is imported only where needed, so
`tessel serve` reads the defaults without the runtime extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessel.errors import TesselError

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # 8 MiB: two million 4-byte characters plus JSON overhead
DEFAULT_MAX_PROMPT_CHARS = 1_000_000  # about 250K tokens of English, above most models' context
DEFAULT_TOKENIZER_THREADS = 2  # a huge prompt tokenizing on one leaves the other to short ones
DEFAULT_MAX_ENGINE_RESTARTS = 3  # engine failures not pinned on a request before the server exits


@dataclass(slots=True)
class ServerLimits:
    """`max_prompt_tokens=None`: the engine's max_model_len is the only token limit."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_prompt_tokens: int | None = None
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS
    max_engine_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise TesselError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise TesselError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_engine_restarts < 0:
            raise TesselError(f"max_engine_restarts must be >= 0, got {self.max_engine_restarts}")

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
            from tessel.server.errors import response_for

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
