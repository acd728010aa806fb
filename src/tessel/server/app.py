"""The FastAPI application: OpenAI's `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

`create_app(engine)` wraps an `LLMEngine` in an `AsyncEngine` whose thread starts and stops with
the app (its lifespan). Bodies over `limits.max_body_bytes` get 413, bodies not in full within
`limits.body_timeout_s` 408 and a closed connection; prompts over
`max_prompt_chars` (before tokenizing) or `max_prompt_tokens` (after) get 400 naming the limit;
tokenizing runs on the `AsyncEngine`'s tokenizer threads, never on the engine thread. A request
whose client goes away is aborted, streamed or not, so its KV blocks return to the pool at once:
streams are cancelled by Starlette when it sees the disconnect; a non-streamed request is raced
against a task that waits for the disconnect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from tessel.engine.guided.spec import GuidedDecoding
from tessel.engine.sampling_params import MAX_SEED
from tessel.errors import TesselError
from tessel.server.async_engine import AsyncEngine, RequestStream
from tessel.server.disconnect import unless_disconnected
from tessel.server.embeddings import add_embeddings_route
from tessel.server.http_errors import ModelNotFoundError, install_error_handlers, response_for
from tessel.server.limits import BodyReadTimeout, BodySizeLimit, ServerLimits
from tessel.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from tessel.server.prometheus import ServerMetrics
from tessel.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDelta,
    ToolCallItem,
    UsageInfo,
)
from tessel.server.tools import ToolCalling, ToolCallStream, parse_tool_calls, tool_calling
from tessel.text import check_text

DEFAULT_MAX_PENDING = 256  # requests held at once (running + waiting) before a 429
_CLIENT_CLOSED_REQUEST = 499  # nginx's code for "client went away"; nobody reads this response


class _ServedEngine:
    """The engine `async_engine` drives now (a pipeline server builds a new one after a stage failure):
    the routes and metrics read it through this, never hold the first one."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self._async_engine = async_engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._async_engine.engine, name)


def create_app(
    engine: Any,
    *,
    max_pending: int = DEFAULT_MAX_PENDING,
    model_name: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """An ASGI app serving `engine` (an `LLMEngine`); `app.state.async_engine` drives it."""
    limits = limits or ServerLimits()
    async_engine = AsyncEngine(
        engine,
        max_pending=max_pending,
        tokenizer_threads=limits.tokenizer_threads,
        max_restarts=limits.max_engine_restarts,
    )
    served_name = model_name or engine.model_name

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="tessel", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_body_bytes=limits.max_body_bytes)
    app.add_middleware(BodyReadTimeout, body_timeout_s=limits.body_timeout_s)  # 408, then close
    app.state.async_engine = async_engine
    app.state.model_name = served_name
    app.state.limits = limits
    token_text = TokenText(engine.tokenizer)  # event loop only
    served = _ServedEngine(async_engine)
    metrics = ServerMetrics(served)
    async_engine.on_outputs = metrics.observe
    app.state.metrics = metrics
    install_error_handlers(app)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        unavailable = async_engine.unavailable()  # failed, or a pipeline being rebuilt (Retry-After)
        if unavailable is not None:
            return response_for(unavailable)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text format (`tessel.server.prometheus`)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=served_name, created=created, max_model_len=served.max_model_len)
        return ModelList(data=[card])

    async def generate(
        raw: Request, body: Any, request_id: str, prompt: Any, prompt_ids: list[int], params: Any, chunks: Any
    ) -> Any:
        """Queue the request's `n` choices; a streaming response, or their final outputs (or a 499).

        With n > 1 the first choice runs its prefill alone; the others are added once its prompt
        blocks are computed, so they take the prompt's full KV blocks from the prefix cache.
        """
        limits.check_prompt_tokens(len(prompt_ids))
        streams: list[RequestStream] = []
        try:
            for index in range(body.n):
                rid = request_id if body.n == 1 else f"{request_id}-{index}"
                added = async_engine.add(
                    rid, prompt, _choice_params(params, index), prompt_token_ids=prompt_ids
                )
                stream = await _cancel_on_disconnect(raw, added)
                if isinstance(stream, Response):
                    return stream
                streams.append(stream)
                if index == 0 and body.n > 1:
                    waited = await _cancel_on_disconnect(raw, stream.started())
                    if isinstance(waited, Response):
                        return waited
        except BaseException:
            _abort_all(streams)
            raise
        if len(streams) < body.n:  # the client left
            _abort_all(streams)
        if body.stream:
            return _event_stream(streams, chunks(streams, served_name, body.include_usage()))
        return await _final_outputs(raw, streams)

    async def compiled(guided: GuidedDecoding | None) -> GuidedDecoding | None:
        """`guided` compiled (and cached) on a tokenizer thread, so the engine thread finds it ready;
        a schema or grammar that cannot guide decoding is a 400 here."""
        if guided is not None:
            await async_engine.tokenize(lambda _: served.guided.compile(guided))
        return guided

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        _check_model(body.model, served_name)
        guided = await compiled(body.guided())
        params = _sampling_params(body, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, guided)
        prompt = body.prompt
        if isinstance(prompt, str):
            limits.check_prompt_chars(len(prompt))
            prompt_ids = await async_engine.tokenize(lambda tokenizer: served.tokenize(prompt, tokenizer))
        else:
            limits.check_prompt_tokens(len(prompt))
            prompt_ids = prompt
        echo = ""
        if body.echo:
            echo = (
                prompt if isinstance(prompt, str) else await async_engine.tokenize(lambda t: t.decode(prompt))
            )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        chunks = functools.partial(_completion_chunks, echo=echo, body=body, text=token_text)
        finals = await generate(raw, body, request_id, prompt, prompt_ids, params, chunks)
        if isinstance(finals, Response):
            return finals
        choices = []
        for index, final in enumerate(finals):
            logprobs = None
            if body.logprobs is not None:
                entries, ids = final.logprobs, final.token_ids
                if body.echo:
                    entries, ids = final.prompt_logprobs + entries, final.prompt_token_ids + ids
                logprobs = completion_logprobs(entries, token_text, ids)
            text, reason = echo + final.text, final.finish_reason
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason))
        usage = _usage(finals)
        response = CompletionResponse(id=request_id, model=served_name, choices=choices, usage=usage)
        return JSONResponse(response.model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        _check_model(body.model, served_name)
        limits.check_prompt_chars(sum(len(m.text()) for m in body.messages))
        calls = None
        if body.calls_tools():
            calls = tool_calling(body.tools, body.chosen_tool(), body.parallel_tool_calls, served.tokenizer)
        guided = await compiled(calls.grammar if calls is not None else body.guided())
        # no max_tokens: OpenAI's default, whatever the context has left (the engine's None)
        params = _sampling_params(body, body.requested_max_tokens(), guided)
        messages = [m.template_dict() for m in body.messages]
        tools = [tool.template_dict() for tool in body.tools] if calls is not None else None
        prompt_ids = await async_engine.tokenize(
            lambda tokenizer: _chat_prompt_ids(tokenizer, messages, tools)
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        chunks = functools.partial(_chat_chunks, body=body, text=token_text, calls=calls)
        finals = await generate(raw, body, request_id, prompt_ids, prompt_ids, params, chunks)
        if isinstance(finals, Response):
            return finals
        choices = []
        for index, final in enumerate(finals):
            message, reason = _assistant_message(final, calls)
            logprobs = chat_logprobs(final.logprobs, token_text) if body.logprobs else None
            choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason))
        response = ChatCompletionResponse(
            id=request_id, model=served_name, choices=choices, usage=_usage(finals)
        )
        return JSONResponse(response.model_dump())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt (or chat messages through the template) -> its token ids."""
        _check_model(body.model, served_name)
        if body.messages is not None:
            limits.check_prompt_chars(sum(len(m.text()) for m in body.messages))
            messages = [m.template_dict() for m in body.messages]
            ids = await async_engine.tokenize(lambda tokenizer: _chat_prompt_ids(tokenizer, messages, None))
        else:
            prompt = body.prompt or ""
            limits.check_prompt_chars(len(prompt))
            ids = await async_engine.tokenize(lambda tokenizer: served.tokenize(prompt, tokenizer))
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=served.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        _check_model(body.model, served_name)
        ids = served.check_token_ids(body.tokens)
        return DetokenizeResponse(prompt=await async_engine.tokenize(lambda tokenizer: tokenizer.decode(ids)))

    add_embeddings_route(app, None, served_name, limits)  # a decoder: 400, embeddings need an encoder
    return app


# ---- helpers -----------------------------------------------------------------------------------


def _check_model(requested: str | None, served_name: str) -> None:
    if requested is not None and requested != served_name:
        raise ModelNotFoundError(
            f"model {requested!r} is not served here; this server serves {served_name!r}"
        )


def _sampling_params(body: Any, max_tokens: int | None, guided: GuidedDecoding | None) -> Any:
    from tessel.engine.sampling_params import SamplingParams

    if isinstance(body, ChatCompletionRequest):
        logprobs, prompt_logprobs = ((body.top_logprobs or 0) if body.logprobs else None), None
    else:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo else None
    return SamplingParams(
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_tokens=max_tokens,
        stop=body.stop_list(),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        guided=guided,
    )


def _chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise TesselError("this model's tokenizer has no chat template; use /v1/completions instead")
    for message in messages:
        for field, text in message.items():
            if isinstance(text, str):
                check_text(text, field)
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as error:  # the template's own checks (roles must alternate, ...) are user errors
        raise TesselError(f"the chat template rejected the messages: {error}") from error
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _assistant_message(final: Any, calls: ToolCalling | None) -> tuple[AssistantMessage, str | None]:
    """The reply, its tool calls parsed out when tools were offered (finish_reason "tool_calls")."""
    if calls is None:
        return AssistantMessage(content=final.text), final.finish_reason
    content, found = parse_tool_calls(final.text, calls.format, calls.names)
    if not found:
        return AssistantMessage(content=final.text), final.finish_reason
    items = [ToolCallItem(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in found]
    reason = "tool_calls" if final.finish_reason == "stop" else final.finish_reason
    return AssistantMessage(content=content, tool_calls=items), reason


def _usage(outputs: list[Any]) -> UsageInfo:
    """The prompt counted once, the completions of every choice summed (OpenAI's usage for n > 1)."""
    prompt = outputs[0].num_prompt_tokens
    completion = sum(output.num_output_tokens for output in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _choice_params(params: Any, index: int) -> Any:
    """Choice i samples with seed + i (mod 2**64): its own stream; choice 0 is the n = 1 answer."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (MAX_SEED + 1))


def _abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first (a cancelled request aborts)."""
    left, result = await unless_disconnected(request, work)
    return Response(status_code=_CLIENT_CLOSED_REQUEST) if left else result


async def _final_outputs(request: Request, streams: list[RequestStream]) -> Any:
    """Each choice's last output, or a 499 response if the client went away first."""
    tasks = [asyncio.ensure_future(stream.final()) for stream in streams]
    try:
        return await _cancel_on_disconnect(request, asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # one choice failed: stop waiting for the others
        _abort_all(streams)  # no-op once finished; covers a task cancelled before it ever ran


def _event_stream(streams: list[RequestStream], chunks: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events; the requests are aborted once the response ends, however it ends."""
    return StreamingResponse(
        _guarded(chunks), media_type="text/event-stream", background=BackgroundTask(_abort_all, streams)
    )


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output) from all streams as they come; leaving early aborts them all."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output, None))
        except Exception as error:
            queue.put_nowait((index, None, error))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                remaining -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()


async def _guarded(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass chunks on; an error after the response started becomes an OpenAI error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as error:
        body = json.loads(response_for(error).body)
        yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"


def _sse(model: Any) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _completion_chunks(
    streams: list[RequestStream], model: str, include_usage: bool, *, echo: str, body: Any, text: TokenText
) -> AsyncIterator[str]:
    created, request_id = int(time.time()), _request_id(streams)
    last: dict[int, Any] = {}
    offsets: dict[int, int] = {}  # text_offset counts the token texts, as the non-streamed answer does

    def chunk(index: int, text_delta: str, logprobs: Any = None, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(
            index=index, text=text_delta, logprobs=logprobs, finish_reason=finish_reason
        )
        return _sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice]))

    async for index, output in _merged(streams):
        if index not in last and echo:
            prompt_logprobs = None
            if body.logprobs is not None:
                prompt_logprobs = completion_logprobs(output.prompt_logprobs, text, output.prompt_token_ids)
                offsets[index] = sum(len(token) for token in prompt_logprobs.tokens)
            yield chunk(index, echo, prompt_logprobs)
        last[index] = output
        new_ids, logprobs = output.new_token_ids, None
        if body.logprobs is not None and new_ids:
            offset = offsets.get(index, 0)
            logprobs = completion_logprobs(output.logprobs[-len(new_ids) :], text, new_ids, offset)
            offsets[index] = offset + sum(len(token) for token in logprobs.tokens)
        if output.new_text or output.finished or logprobs is not None:
            reason = output.finish_reason if output.finished else None
            yield chunk(index, output.new_text, logprobs, reason)
    if include_usage and last:
        usage = _usage(list(last.values()))
        yield _sse(CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
    yield "data: [DONE]\n\n"


async def _chat_chunks(
    streams: list[RequestStream],
    model: str,
    include_usage: bool,
    *,
    body: Any,
    text: TokenText,
    calls: ToolCalling | None,
) -> AsyncIterator[str]:
    created, request_id = int(time.time()), _request_id(streams)
    last: dict[int, Any] = {}
    parsers = {i: ToolCallStream(calls.format, calls.names) for i in range(len(streams))} if calls else {}

    def chunk(index: int, delta: DeltaMessage, finish_reason: str | None = None, logprobs: Any = None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return _sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]))

    for index in range(len(streams)):
        yield chunk(index, DeltaMessage(role="assistant", content=""))
    async for index, output in _merged(streams):
        last[index] = output
        new_ids, logprobs = output.new_token_ids, None
        if body.logprobs and new_ids:
            logprobs = chat_logprobs(output.logprobs[-len(new_ids) :], text)
        parser = parsers.get(index)
        if parser is None:
            if output.new_text or logprobs is not None:
                yield chunk(index, DeltaMessage(content=output.new_text), logprobs=logprobs)
        else:
            before = len(parser.calls)
            content, found = parser.feed(output.new_text)
            if output.finished:
                rest, more = parser.finish()
                content, found = content + rest, found + more
            if content or found or logprobs is not None:
                yield chunk(index, _tool_delta(content, found, before), logprobs=logprobs)
        if output.finished:
            reason = output.finish_reason
            if parser is not None and parser.calls and reason == "stop":
                reason = "tool_calls"
            yield chunk(index, DeltaMessage(), finish_reason=reason)
    if include_usage and last:
        usage = _usage(list(last.values()))
        yield _sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage))
    yield "data: [DONE]\n\n"


def _tool_delta(content: str, calls: list[Any], first_index: int) -> DeltaMessage:
    deltas = [
        ToolCallDelta(
            index=first_index + i, id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)
        )
        for i, c in enumerate(calls)
    ]
    return DeltaMessage(content=content or None, tool_calls=deltas or None)


def _request_id(streams: list[RequestStream]) -> str:
    """The response id: the engine request id, without a choice's "-i" suffix when n > 1."""
    rid = streams[0].request_id
    return rid if len(streams) == 1 else rid.rsplit("-", 1)[0]
