"""OpenAI's `/v1/embeddings`: an encoder's app (`create_embedding_app`), the route (`add_embeddings_route`).

`tessel serve --model <encoder dir>` serves `create_embedding_app(Embedder(...))`: `/v1/embeddings`,
`/v1/models`, `/health`; `/v1/completions` and `/v1/chat/completions` answer 400 (an encoder writes
no text). A decoder's app (`tessel.server.app.create_app`) registers the route with no embedder: it
answers 400 saying that embeddings need an encoder.

Requests: `input` is a string, a list of strings, a list of token ids or a list of token id lists
(a text's tokens without special tokens; [CLS]/[SEP] are added); `encoding_format` float (default)
or base64 (little-endian float32, as OpenAI sends); `dimensions` only where the model allows it
(`Embedder.check_dimensions`). Refused with 400 naming the limit: an empty input or empty string,
more than `MAX_INPUTS` inputs, more characters than `--max-prompt-chars` in all, an input over the
model's `max_seq_length` tokens (OpenAI refuses over-long inputs too; nothing is cut), more than
`MAX_REQUEST_TOKENS` tokens in all.

Fairness: tokenizing and each batch of the model run one at a time in a worker thread under FIFO
locks, batch by batch, so a 2,048-input request holds the model for one batch at a time and a
one-sentence request that arrives meanwhile waits for one batch, not the whole request. A client
that disconnects stops its request at the next batch.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Annotated, Any, ClassVar, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, Field, StrictInt

from tessel.errors import TesselError
from tessel.server.http_errors import ModelNotFoundError, install_error_handlers, response_for
from tessel.server.limits import BodyReadTimeout, BodySizeLimit, ServerLimits
from tessel.server.protocol import ModelCard, ModelList, RequestModel
from tessel.text import check_texts

MAX_INPUTS = 2048  # inputs per request: OpenAI's documented limit for /v1/embeddings
MAX_REQUEST_TOKENS = 300_000  # tokens per request, all inputs together: OpenAI's documented limit
_CLIENT_CLOSED_REQUEST = 499


def _inputs(value: Any) -> list[str] | list[list[int]]:
    """`input` as a list of texts or a list of token id lists; what is wrong is named."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ValueError("input must be a string, a list of strings, or token ids (a list, or lists)")
    if not value:
        raise ValueError("input must not be empty")
    if len(value) > MAX_INPUTS:
        raise ValueError(f"input has {len(value)} items; at most {MAX_INPUTS} per request")
    if all(type(item) is int for item in value):
        value = [value]
    if all(isinstance(item, str) for item in value):
        if any(not item.strip() for item in value):
            raise ValueError("input strings must not be empty")
        return check_texts(value, "input")
    if all(isinstance(item, list) and all(type(i) is int for i in item) for item in value):
        if any(not item for item in value):
            raise ValueError("token id lists must not be empty")
        return value
    raise ValueError("input must be all strings or all token id lists (whole numbers), not a mix")


class EmbeddingRequest(RequestModel):
    what: ClassVar[str] = "the embeddings request"
    input: Annotated[list[str] | list[list[int]], BeforeValidator(_inputs)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def add_embeddings_route(app: FastAPI, embedder: Any | None, served_name: str, limits: ServerLimits) -> None:
    """POST /v1/embeddings on `app`; with `embedder=None` (a decoder is served) it answers 400."""
    tokenizer_lock, model_lock = asyncio.Lock(), asyncio.Lock()  # FIFO: requests take turns per batch

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        if body.model is not None and body.model != served_name:
            raise ModelNotFoundError(
                f"model {body.model!r} is not served here; this server serves {served_name!r}"
            )
        if embedder is None:
            raise TesselError(
                f"{served_name} is a decoder (text generation) model; /v1/embeddings needs an encoder: "
                "serve a BERT-family (sentence-transformers) model with `tessel serve --model DIR`"
            )
        embedder.check_dimensions(body.dimensions)
        ids = await _token_ids(embedder, body.input, limits, tokenizer_lock)
        vectors = await _run(embedder, ids, raw, model_lock)
        if vectors is None:
            return Response(status_code=_CLIENT_CLOSED_REQUEST)
        vectors = embedder.shorten(vectors, body.dimensions)
        encoded = [_encode(vector, body.encoding_format) for vector in vectors]
        data = [EmbeddingData(index=i, embedding=vector) for i, vector in enumerate(encoded)]
        tokens = sum(len(row) for row in ids)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return JSONResponse(EmbeddingResponse(data=data, model=served_name, usage=usage).model_dump())


async def _token_ids(
    embedder: Any, inputs: list[str] | list[list[int]], limits: ServerLimits, lock: asyncio.Lock
) -> list[list[int]]:
    if isinstance(inputs[0], str):
        limits.check_prompt_chars(sum(len(text) for text in inputs))
        async with lock:
            ids = await asyncio.to_thread(embedder.tokenize, inputs)
    else:
        ids = [embedder.with_special_tokens(row) for row in inputs]
    total = sum(len(row) for row in ids)
    if total > MAX_REQUEST_TOKENS:
        raise TesselError(f"the inputs have {total} tokens in all; at most {MAX_REQUEST_TOKENS} per request")
    return ids


async def _run(embedder: Any, ids: list[list[int]], raw: Request, lock: asyncio.Lock) -> torch.Tensor | None:
    """All vectors, one batch per turn of the lock; None when the client went away."""
    out = torch.empty((len(ids), embedder.dimensions), dtype=torch.float32)
    for batch in embedder.batches(ids):
        if await raw.is_disconnected():
            return None
        async with lock:
            out[batch] = await asyncio.to_thread(embedder.run_batch, [ids[i] for i in batch])
    return out


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def create_embedding_app(
    embedder: Any, *, model_name: str | None = None, limits: ServerLimits | None = None
) -> FastAPI:
    """The app `tessel serve` runs for an encoder (`tessel.models.embedder.Embedder`)."""
    limits = limits or ServerLimits()
    served_name = model_name or embedder.model_name
    app = FastAPI(title="tessel")
    app.add_middleware(BodySizeLimit, max_body_bytes=limits.max_body_bytes)
    app.add_middleware(BodyReadTimeout, body_timeout_s=limits.body_timeout_s)
    app.state.model_name, app.state.limits, app.state.embedder = served_name, limits, embedder
    install_error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_name, created=created, max_model_len=embedder.max_tokens)])

    async def no_text(raw: Request) -> Response:
        message = f"{served_name} is an encoder (embedding) model: it writes no text; use /v1/embeddings"
        return response_for(TesselError(message))

    app.add_api_route("/v1/completions", no_text, methods=["POST"])
    app.add_api_route("/v1/chat/completions", no_text, methods=["POST"])
    add_embeddings_route(app, embedder, served_name, limits)
    return app
