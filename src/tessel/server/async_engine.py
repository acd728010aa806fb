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
a request) fails the requests in flight with `EngineDeadError` (503), and the error says what can
bring the engine back (`recovery_for`, `Recovery`):

- RESTART (any error that says nothing): clear the engine's requests and step on, up to
  `max_restarts` times; past that, `on_dead` is called (`tessel serve` exits, so a supervisor can
  restart it);
- NONE (a pipeline lost for good: no rebuild left, or the stages left cannot hold the model): the
  server stays up without an engine, answering 503 with the cause on `/health` and to every
  request, instead of exiting and leaving its clients with refused connections.

A lost pipeline stage never reaches this loop as a failure: the supervisor behind a pipeline engine
(`engine.supervisor`, `tessel serve --plan`) rebuilds the pipeline inside the engine's step and
moves the requests into it. While it does, `engine.recovering` names the failure and `/health`
answers 503 with `Retry-After`; new requests wait for the step to end. A live remap is the engine's
too (`remap` here only hands it on and wakes the engine's thread).

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
from enum import Enum
from typing import Any, TypeVar

from tessel.errors import TesselError
from tessel.server.http_errors import EngineDeadError, QueueFullError, RequestFailedError
from tessel.server.limits import DEFAULT_MAX_ENGINE_RESTARTS, DEFAULT_TOKENIZER_THREADS

T = TypeVar("T")

_JOIN_TIMEOUT_S = 30.0  # how long stop() waits for a step in progress to end


class Recovery(str, Enum):
    """What brings the engine back after a step failed for every request."""

    RESTART = "restart"  # fail the requests in flight, clear the engine and step on
    REBUILD = "rebuild"  # a pipeline lost a stage: its supervisor builds a new one (never seen here)
    NONE = "none"  # nothing this process can do


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


def recovery_for(error: BaseException) -> Recovery:
    """The recovery `error` asks for: its `recovery` attribute, else RESTART."""
    declared = getattr(error, "recovery", None)
    return Recovery.RESTART if declared is None else Recovery(declared)


def restart_can_fix(error: BaseException) -> bool:
    """Whether restarting the engine loop (with the same engine) may cure `error`."""
    return recovery_for(error) is Recovery.RESTART


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
        engine.wake = self._wake  # a pipeline's supervisor wakes the engine thread when it has work

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
        return self.unavailable() is None

    def unavailable(self) -> EngineDeadError | None:
        """Why the engine cannot take requests now (503, with Retry-After while it is rebuilt), or None."""
        with self._cond:
            error, stopping = self.error, self._stopping
        supervisor = getattr(self.engine, "supervisor", None)
        rebuilding = getattr(self.engine, "recovering", None)
        if rebuilding is not None:
            return EngineDeadError(
                f"the engine failed: {_describe(rebuilding)}; the pipeline is restarting (rebuild "
                f"{supervisor.num_rebuilds} of at most {supervisor.max_rebuilds}); retry the request",
                retry_after_s=supervisor.retry_after_s,
            )
        if error is not None:
            return EngineDeadError(f"the engine failed: {_describe(error)}")
        if stopping:
            return EngineDeadError("the server is shutting down")
        if self._thread is None or not self._thread.is_alive():
            return EngineDeadError("the engine failed: its thread is not running")
        return None

    @property
    def num_pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    # ---- the API the routes use ----------------------------------------------------------------

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread (between two steps) and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def _wake(self) -> None:
        self.submit(lambda: None)

    def remap(self, new_plan: Any, reason: str) -> Future:
        """Move serving to the pipeline of `new_plan` without stopping (the engine's supervisor does;
        see `tessel.pipeline.supervision.supervisor`); callable from any thread."""
        return self.engine.remap(new_plan, reason)

    @property
    def last_recovery(self) -> Any:
        """The last rebuild's figures (a pipeline engine's supervisor's), or None."""
        supervisor = getattr(self.engine, "supervisor", None)
        return None if supervisor is None else supervisor.last_recovery

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between two steps (callable from any thread)."""
        future: Future = Future()
        with self._cond:
            refused = self.error is not None or self._stopping
            if not refused:
                self._commands.append((fn, future))
                self._cond.notify_all()
        if refused:
            future.set_exception(self.unavailable() or EngineDeadError("the engine is not running"))
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
                if not self._recover(error):
                    return
                outputs = []
            except BaseException as error:
                self._die(error)
                return
            self._observe(outputs)
            for output in outputs:  # its text decoded here: the detokenizers are this thread's
                self._deliver(output.request_id, output.resolve(), finished=output.finished)
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

    def _recover(self, error: BaseException) -> bool:
        """Recover from a step that failed for every request; False: the engine stays down."""
        if recovery_for(error) is Recovery.RESTART and self.num_restarts < self.max_restarts:
            self._restart(error)
            return True
        self._die(error, notify=recovery_for(error) is Recovery.RESTART)
        return False

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
        dead = EngineDeadError(f"the engine failed: {_describe(error)}")
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


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
