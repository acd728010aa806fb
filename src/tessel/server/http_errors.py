"""Errors of the HTTP server, and their OpenAI-shaped bodies.

Every error a client sees has the body `{"error": {"message", "type", "param", "code"}}` that
OpenAI's API returns, so OpenAI's clients raise their usual exceptions (`BadRequestError` for a
400, `RateLimitError` for a 429, ...).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessel.errors import TesselError
from tessel.server.protocol import ErrorInfo, ErrorResponse


class QueueFullError(TesselError):
    """The server already holds as many requests as it may queue; the client should retry later."""


class EngineDeadError(TesselError):
    """The engine thread stopped on an unexpected error; the server cannot generate any more.

    `retry_after_s`: set while the engine is being rebuilt (a pipeline after a stage failure): the
    response carries it as `Retry-After`."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotFoundError(TesselError):
    """The request names a model this server does not serve."""


class RequestFailedError(Exception):
    """Running this one request failed unexpectedly (HTTP 500); the engine serves the others on."""


def _printable(text: str) -> str:
    """Text that JSON can carry as UTF-8: a lone surrogate echoed from the input becomes '\\ud800'."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status_code: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    param = None if param is None else _printable(param)
    body = ErrorResponse(error=ErrorInfo(message=_printable(message), type=type_, param=param, code=code))
    return JSONResponse(status_code=status_code, content=body.model_dump())


def response_for(error: Exception) -> JSONResponse:
    """The HTTP response for an error raised while serving a request."""
    if isinstance(error, QueueFullError):
        return error_response(429, str(error), "rate_limit_exceeded", code="queue_full")
    if isinstance(error, EngineDeadError):
        response = error_response(503, str(error), "engine_error", code="engine_dead")
        if error.retry_after_s is not None:
            response.headers["Retry-After"] = str(error.retry_after_s)
        return response
    if isinstance(error, ModelNotFoundError):
        return error_response(404, str(error), "invalid_request_error", param="model", code="model_not_found")
    if isinstance(error, TesselError):
        return error_response(400, str(error), "invalid_request_error")
    if isinstance(error, StarletteHTTPException):
        type_ = "invalid_request_error" if error.status_code < 500 else "internal_error"
        return error_response(error.status_code, str(error.detail), type_)
    if isinstance(error, RequestFailedError):
        return error_response(500, str(error), "internal_error", code="request_failed")
    return error_response(500, f"internal error: {type(error).__name__}: {error}", "internal_error")


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    problems = []
    param = None
    for item in error.errors():
        if item.get("type") == "json_invalid":
            detail = item.get("ctx", {}).get("error", "")
            return error_response(
                400, f"the request body is not valid JSON: {detail}", "invalid_request_error"
            )
        location = [str(part) for part in item.get("loc", ()) if part != "body"]
        where = ".".join(location)
        param = param or where or None
        message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    return error_response(400, "; ".join(problems) or "invalid request body", "invalid_request_error", param)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return response_for(error)


async def _tessel_error(request: Request, error: TesselError) -> JSONResponse:
    return response_for(error)


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    return response_for(error)


def install_error_handlers(app) -> None:
    """Make FastAPI answer validation, routing and engine errors in OpenAI's error shape."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(TesselError, _tessel_error)
    app.add_exception_handler(Exception, _unexpected_error)
