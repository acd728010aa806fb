"""Drive an `LLMEngine` from asyncio: one background thread owns the engine.

The engine is not thread-safe, so only its thread touches it. The event loop hands it work as
commands (add a request, abort one, run a callable such as a chat template) that the thread runs
between two `step()`s; results come back through futures, and each request's outputs come back
through its own `asyncio.Queue`, fed with `loop.call_soon_threadsafe`.

Tokenizing (and chat templates) runs off the engine thread, on a small pool of tokenizer threads
each with its own copy of the tokenizer (HF fast tokenizers may refuse concurrent use of one
object: "Already borrowed"; they release the GIL while encoding), so a huge prompt never delays
the steps of the requests already running nor the tokenizing of a short one on another thread.

A request that fails alone comes back as an output with finish_reason "error" and raises from its
stream (400 for a `TesselError`, else 500). A step that fails for every request (the engine, not
a request) fails the requests in flight with `EngineDeadError` (503) and restarts the loop, at most
`max_restarts` times; then the engine is dead for good, `/health` says so and `on_dead` is called
(`tessel serve` exits, so a supervisor can restart it). Only failures a restart can fix count: an
error whose `restart_can_fix` attribute is False (a pipeline stage that died or fell silent,
`tessel.pipeline.launcher.StageFailedError`) stops the loop at once without spending the budget and
without `on_dead`: the server stays up, answering 503 with the cause on `/health` and to every
request, instead of exiting and leaving its clients with refused connections.

The server holds at most `max_pending` unfinished requests (running plus waiting); one more is
refused with `QueueFullError` (HTTP 429) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tessel.errors import TesselError
from tessel.server.errors import EngineDeadError, QueueFullError, RequestFailedError
from tessel.server.limits import DEFAULT_MAX_ENGINE_RESTARTS, DEFAULT_TOKENIZER_THREADS

T = TypeVar("T")

_JOIN_TIMEOUT_S = 30.0  # how long stop() waits for a step in progress to end


class RequestStream:
    """The outputs of one request, in order; the last one has `finished` set.

    Leaving the iteration early (a client that went away, a cancelled task) aborts the request,
    which frees its KV blocks.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue, owner: AsyncEngine) -> None:
        self.request_id = request_id
        self._queue = queue
        self._owner = owner
        self._done = False
        self._peeked: deque[Any] = deque()

    async def started(self) -> None:
        """Wait for the first output (its prompt is computed); the iteration still yields it."""
        if not self._peeked:
            self._peeked.append(await self._queue.get())

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            while not self._done:
                item = self._peeked.popleft() if self._peeked else await self._queue.get()
                if isinstance(item, BaseException):
                    self._close(abort=False)
                    raise item
                if item.finish_reason == "error":
                    self._close(abort=False)
                    raise _request_error(item.error)
                if item.finished:
                    self._close(abort=False)
                yield item
        finally:
            self.abort()

    async def final(self) -> Any:
        """Wait for the request to finish and return its last output."""
        last = None
        async for output in self:
            last = output
        return last

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if self._done:
            return
        self._done = True
        self._owner._release(self.request_id, abort=abort)


def restart_can_fix(error: BaseException) -> bool:
    """Whether restarting the engine loop may cure `error` (False for an error that says it cannot)."""
    return getattr(error, "restart_can_fix", True) is not False


def _request_error(error: BaseException | None) -> Exception:
    if isinstance(error, TesselError):
        return error
    return RequestFailedError(f"this request failed: {type(error).__name__}: {error}")


class AsyncEngine:
    """An `LLMEngine` stepped by a background thread, fed and read from asyncio."""

    def __init__(
        self,
        engine: Any,
        max_pending: int,
        tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
        max_restarts: int = DEFAULT_MAX_ENGINE_RESTARTS,
    ) -> None:
        if max_pending < 1:
            raise TesselError(f"max_pending must be at least 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self.max_restarts = max_restarts
        self.num_restarts = 0
        self.on_dead: Callable[[], None] | None = None  # called once the engine cannot restart
        self.on_outputs: Callable[[list[Any], float], None] | None = None  # each step's outputs (metrics)
        self.num_aborted = 0  # requests aborted before they finished (clients that went away)
        self.error: BaseException | None = None
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="tessel-tokenizer")
        self._local = threading.local()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._queues: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}  # engine thread only
        self._pending_lock = threading.Lock()
        self._pending: set[str] = set()

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tessel-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=_JOIN_TIMEOUT_S)
            self._thread = None
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    # ---- the API the routes use ----------------------------------------------------------------

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread (between two steps) and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between two steps (callable from any thread)."""
        future: Future = Future()
        with self._cond:
            if self.error is not None or self._stopping:
                future.set_exception(EngineDeadError(f"the engine is not running: {self.error}"))
                return future
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future

    async def tokenize(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(tokenizer)` on a tokenizer thread (its own copy of the engine's tokenizer)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, self._with_tokenizer, fn
        )

    def _with_tokenizer(self, fn: Callable[[Any], T]) -> T:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self.engine.tokenizer)
        return fn(tokenizer)

    async def add(
        self, request_id: str, prompt: str | list[int], params: Any, prompt_token_ids: list[int] | None = None
    ) -> RequestStream:
        """Queue a request; raises `QueueFullError` when full and the engine's `TesselError`s."""
        with self._pending_lock:
            if len(self._pending) >= self.max_pending:
                raise QueueFullError(
                    f"the server is full: {len(self._pending)} requests are running or waiting "
                    f"(limit {self.max_pending}); retry later"
                )
            if request_id in self._pending:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._pending.add(request_id)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, queue, self)
        try:
            await self.call(lambda: self._add_now(request_id, prompt, params, prompt_token_ids, queue, loop))
        except BaseException:
            stream.abort()  # also covers a cancellation that arrives after the engine added it
            raise
        return stream

    # ---- engine thread -------------------------------------------------------------------------

    def _release(self, request_id: str, abort: bool) -> None:
        with self._pending_lock:
            self._pending.discard(request_id)
        if abort:
            self.submit(lambda: self._abort_now(request_id))

    def _add_now(self, request_id, prompt, params, prompt_token_ids, queue, loop) -> None:
        if prompt_token_ids is None:
            self.engine.add_request(request_id, prompt, params)
        else:
            self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids)
        self._queues[request_id] = (queue, loop)

    def _abort_now(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is None:
            return  # finished (or never added) before the abort came
        self.engine.abort_request(request_id)
        self.num_aborted += 1

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as error:  # handed to the awaiting coroutine
                        future.set_exception(error)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:
                if not restart_can_fix(error):
                    self._die(error, notify=False)
                    return
                if self.num_restarts >= self.max_restarts:
                    self._die(error)
                    return
                outputs = self._restart(error)
            except BaseException as error:
                self._die(error)
                return
            self._observe(outputs)
            for output in outputs:
                self._deliver(output.request_id, output, finished=output.finished)
        stopped = EngineDeadError("the server is shutting down")
        for request_id in list(self._queues):
            self._deliver(request_id, stopped, finished=True)
        self._fail_commands(stopped)

    def _deliver(self, request_id: str, item: Any, finished: bool) -> None:
        entry = self._queues.pop(request_id, None) if finished else self._queues.get(request_id)
        if entry is None:
            return
        queue, loop = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody will read this request
            self._queues.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _restart(self, error: BaseException) -> list[Any]:
        """Fail what is in flight with 503, clear the engine and go on; -> no outputs to deliver."""
        self.num_restarts += 1
        failed = EngineDeadError(
            f"the engine failed ({type(error).__name__}: {error}) and restarted "
            f"({self.num_restarts} of at most {self.max_restarts} restarts); retry the request"
        )
        for request_id in list(self._queues):
            self._deliver(request_id, failed, finished=True)
        self._observe(self.engine.reset(error))
        return []

    def _observe(self, outputs: list[Any]) -> None:
        if self.on_outputs is not None and outputs:
            self.on_outputs(outputs, time.time())

    def _die(self, error: BaseException, notify: bool = True) -> None:
        """Fail everything with 503 and stop the loop; `notify`: call `on_dead` (the server exits)."""
        with self._cond:
            self.error = error
        dead = EngineDeadError(f"the engine failed: {type(error).__name__}: {error}")
        for request_id in list(self._queues):
            self._deliver(request_id, dead, finished=True)
        self._fail_commands(dead)
        if notify and self.on_dead is not None:
            self.on_dead()

    def _fail_commands(self, error: BaseException) -> None:
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
