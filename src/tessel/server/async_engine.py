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
a request) fails the requests in flight with `EngineDeadError` (503) and recovers the way the
error asks (`recovery_for`, `Recovery`):

- RESTART (any error that says nothing): clear the engine's requests and step on;
- REBUILD (`recovery = "rebuild"`: a pipeline stage died or fell silent, the process group is
  broken): `rebuild(old_engine)` builds a new engine (a new pipeline: after a lost stage, on the
  surviving stages, `ServedPipelineEngine.rebuilt`) on the engine thread, and the requests in flight
  are moved into it (`tessel.pipeline.remap.migrate_requests`: recomputed there, their streams go
  on without an error or a repeated token). While it runs, `/health` answers 503 naming the failure,
  with `Retry-After`, and new requests wait for the new engine. When the rebuild fails (the
  survivors cannot hold the model: `SurvivorsTooSmallError`), what was in flight fails with 503 and
  the reason;
- NONE: nothing this process can do.

Live remap: `remap(new_plan: Path | RunPlan, reason: str) -> concurrent.futures.Future[RemapReport]`
(any thread) moves a pipeline engine (`ServedPipelineEngine`) to another split while it serves:
1. on the engine thread, between two steps, `engine.successor(new_plan)` spawns the new split's
   stage processes (`PendingPipeline`), which load their layers and then wait to join;
2. on a background thread, `PendingPipeline.load()` loads the new stage 0's layers here and waits
   until every new stage has loaded; the old pipeline serves meanwhile;
3. on the engine thread, between two steps (the switch): the old pipeline's micro-batches in
   flight are finished and delivered, the old stages stopped, the new process group joined, and the
   unfinished requests moved into the new engine (recomputed); commands (new requests) that came
   meanwhile run right after, so a new request waits at most one switch.
The future resolves once every moved stream has its next token: `RemapReport` gives `load_s`,
`switch_s`, the requests `moved` and `max_gap_s`, the longest time between two tokens of a moved
stream (also logged). A remap that fails halfway resolves with `ok=False`, `rolled_back=True` and
the `error`: a new stage that dies or runs out of memory while loading leaves the old pipeline
serving untouched (its stages are stopped); a failure while joining (after the old one stopped)
builds the old split again and moves the requests there. A remap refused before anything started
(a bad plan, one already under way, an engine that is not a pipeline) raises `TesselError` from the
future. Remaps do not count against `max_restarts`.

Each restart and each rebuild counts against `max_restarts`. A RESTART failure past the budget
calls `on_dead` (`tessel serve` exits, so a supervisor can restart it). A REBUILD failure past
the budget, one with no `rebuild`, a rebuild that fails and a NONE failure leave the server up
for good without an engine, answering 503 with the cause on `/health` and to every request,
instead of exiting and leaving its clients with refused connections.

The server holds at most `max_pending` unfinished requests (running plus waiting); one more is
refused with `QueueFullError` (HTTP 429) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from tessel.errors import TesselError
from tessel.server.http_errors import EngineDeadError, QueueFullError, RequestFailedError
from tessel.server.limits import DEFAULT_MAX_ENGINE_RESTARTS, DEFAULT_TOKENIZER_THREADS

T = TypeVar("T")

_JOIN_TIMEOUT_S = 30.0  # how long stop() waits for a step in progress to end
REBUILD_RETRY_AFTER_S = 5  # Retry-After while the engine is being rebuilt, before one rebuild was timed

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RemapReport:
    """What a remap (or a rebuild after a lost stage) did, for logs and for whoever asked for it."""

    reason: str
    plan: str  # the plan file of the pipeline asked for
    ok: bool
    error: str | None = None  # why it failed (`ok` False)
    rolled_back: bool = False  # it failed and the old split serves (requests intact)
    load_s: float = 0.0  # spawning the new stages until every stage had loaded its layers
    switch_s: float = 0.0  # the engine thread's pause: old pipeline drained and stopped, new joined
    moved: int = 0  # requests moved into the new pipeline (recomputed there)
    max_gap_s: float | None = None  # the longest time between two tokens of a moved stream


def _plan_name(engine: Any) -> str:
    plan = getattr(engine, "plan", None)
    return str(getattr(plan, "path", "?"))


class Recovery(str, Enum):
    """What brings the engine back after a step failed for every request."""

    RESTART = "restart"  # fail the requests in flight, clear the engine and step on
    REBUILD = "rebuild"  # the engine is broken (a pipeline lost a stage): build a new one
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
        # builds a new engine in place of the broken one it is given (which it closes first)
        self.rebuild: Callable[[Any], Any] | None = None
        self.rebuilding: BaseException | None = None  # the failure being recovered from by a rebuild
        self.num_rebuilds = 0
        self._dead_note = ""  # why the engine stays down, after the cause
        self._retry_after_s = REBUILD_RETRY_AFTER_S
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
        self._remapping = False  # a remap is under way (one at a time)
        self.last_recovery: RemapReport | None = None  # the last rebuild's figures
        self._last_token_s: dict[str, float] = {}  # engine thread: when each stream got its last token
        self._gap_watch: dict[str, float] = {}  # streams moved by the last switch, not yet resumed
        self._gap_report: tuple[RemapReport, Future | None] | None = None

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
            rebuilding, error, stopping = self.rebuilding, self.error, self._stopping
        if rebuilding is not None:
            return EngineDeadError(
                f"the engine failed: {_describe(rebuilding)}; the pipeline is restarting (rebuild "
                f"{self.num_restarts} of at most {self.max_restarts}); retry the request",
                retry_after_s=self._retry_after_s,
            )
        if error is not None:
            return EngineDeadError(f"the engine failed: {_describe(error)}{self._dead_note}")
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

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between two steps (callable from any thread)."""
        future: Future = Future()
        with self._cond:
            refused = self.error is not None or self._stopping  # while rebuilding: run on the new engine
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
        self._gap_watch.pop(request_id, None)
        self._last_token_s.pop(request_id, None)
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
            if self.error is not None:
                return  # a command left the server without an engine (a remap that could not roll back)
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
            self._track(outputs)
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

    def _recover(self, error: BaseException) -> bool:
        """Recover from a step that failed for every request; False: the engine stays down."""
        recovery = recovery_for(error)
        spent = self.num_restarts >= self.max_restarts
        if recovery is Recovery.RESTART and not spent:
            self._restart(error)
            return True
        if recovery is Recovery.RESTART:
            self._die(error)
            return False
        if recovery is Recovery.REBUILD and self.rebuild is not None and not spent:
            return self._rebuild(error)
        if recovery is Recovery.REBUILD and self.rebuild is not None:
            self._dead_note = (
                f"; the pipeline was rebuilt {self.num_rebuilds} times and no restarts are left "
                f"(--max-engine-restarts {self.max_restarts}): it stays down until the server restarts"
            )
        self._die(error, notify=False)
        return False

    def _rebuild(self, error: BaseException) -> bool:
        """Build a new engine in place of this one and move the requests in flight into it
        (`tessel.pipeline.remap.migrate_requests`: they continue, recomputed); False (the server stays
        up without an engine, what was in flight fails with 503 and the reason) when that fails."""
        with self._cond:
            self.num_restarts += 1
            self.rebuilding = error
        log.warning(
            "tessel: rebuilding the pipeline (%d of at most %d) after %s; %d requests in flight wait",
            self.num_restarts,
            self.max_restarts,
            _describe(error),
            len(self._queues),
        )
        started = time.monotonic()
        old = self.engine
        try:
            engine = self.rebuild(old)
        except Exception as rebuild_error:
            took_s = time.monotonic() - started
            failure = _describe(rebuild_error)
            log.error("tessel: the pipeline rebuild failed after %.1f s: %s", took_s, failure)
            self._dead_note = f" (rebuilding the pipeline after {_describe(error)})"
            self._die(rebuild_error, notify=False)
            return False
        report = RemapReport(f"rebuild after {_describe(error)}", _plan_name(engine), ok=True)
        self._install(old, engine, report, started)
        log.warning(
            "tessel: the pipeline is back after %.1f s with %d requests moved into it (cause: %s)",
            report.switch_s,
            report.moved,
            _describe(error),
        )
        with self._cond:
            self.num_rebuilds += 1
            self._retry_after_s = max(1, round(report.switch_s))
            self.rebuilding = None
            self.last_recovery = report
        self._settle_gap()
        return True

    # ---- moving to a new pipeline ----------------------------------------------------------------

    def remap(self, new_plan: Any, reason: str) -> Future[RemapReport]:
        """Move serving to the pipeline of `new_plan` (a plan file path or a `RunPlan`) without
        stopping: see the module's "Live remap". Callable from any thread; the future's result is a
        `RemapReport` (`ok` False: the remap failed and rolled back, `error` says why); it raises
        `TesselError` when the remap is refused before anything started (a bad plan, one already
        under way, an engine that cannot remap)."""
        done: Future = Future()
        if not hasattr(self.engine, "successor"):
            done.set_exception(TesselError("this engine cannot remap: it is not a pipeline (serve --plan)"))
            return done
        with self._cond:
            busy = self._remapping
            self._remapping = True
        if busy:
            done.set_exception(TesselError("a remap is already under way; wait for its future"))
            return done
        report = RemapReport(reason, str(getattr(new_plan, "path", new_plan)), ok=False)
        spawned = self.submit(lambda: self.engine.successor(new_plan))  # spawned on the engine thread

        def load(spawned: Future) -> None:
            error = spawned.exception()
            if error is not None:
                self._remap_done(done, report, error=error, refused=True)
                return
            pending = spawned.result()
            started = time.monotonic()
            try:
                pending.load()
            except Exception as load_error:  # a new stage died, ran out of memory, ...
                pending.abandon()
                report.load_s = time.monotonic() - started
                self._remap_done(done, report, error=load_error)
                return
            report.load_s = time.monotonic() - started
            switched = self.submit(lambda: self._switch(pending, report, done))
            switched.add_done_callback(lambda f: self._switch_failed(f, pending, done, report))

        spawned.add_done_callback(lambda f: threading.Thread(target=load, args=(f,), daemon=True).start())
        return done

    def _switch(self, pending: Any, report: RemapReport, done: Future) -> None:
        """Engine thread, between two steps: finish the old pipeline's micro-batches in flight, stop
        it, join the new one and move the requests into it; when joining fails, rebuild the old split
        and move them there (rolled back)."""
        started = time.monotonic()
        old = self.engine
        try:
            outputs = old.drain()
        except Exception as error:  # the old pipeline broke meanwhile: its requests are recomputed
            log.warning("tessel: remap: the old pipeline failed while draining: %s", _describe(error))
            outputs = []
        self._observe(outputs)
        self._track(outputs)
        for output in outputs:
            self._deliver(output.request_id, output, finished=output.finished)
        old.close()
        try:
            engine = pending.join()
        except Exception as join_error:
            report.error = f"joining the new pipeline failed: {_describe(join_error)}"
            log.error("tessel: remap (%s) failed: %s; rolling back", report.reason, report.error)
            try:
                engine = old.restarted(self)
            except Exception as rollback_error:
                self._dead_note = f" (rolling back a failed remap: {report.error})"
                self._die(rollback_error, notify=False)
                self._remap_done(done, report, error=rollback_error)
                return
            report.rolled_back = True
            self._install(old, engine, report, started)
            self._remap_done(done, report, error=join_error)
            return
        engine.watch_stages(self)
        self._install(old, engine, report, started)
        report.ok = True
        log.warning(
            "tessel: remapped (%s) to %s: loaded beside in %.1f s, switched in %.2f s, %d requests moved",
            report.reason,
            report.plan,
            report.load_s,
            report.switch_s,
            report.moved,
        )
        self._gap_report = (report, done)
        self._settle_gap()

    def _switch_failed(self, switched: Future, pending: Any, done: Future, report: RemapReport) -> None:
        """The switch never ran (the engine is down) or raised: stop the new stages, say so."""
        error = switched.exception()
        if error is not None:
            pending.abandon()
            self._remap_done(done, report, error=error)

    def _install(self, old: Any, engine: Any, report: RemapReport, started: float) -> None:
        """Engine thread: `engine` serves from now on, with `old`'s unfinished requests moved in."""
        from tessel.pipeline.remap import migrate_requests

        moved = migrate_requests(old, engine)
        with self._cond:
            self.engine = engine
        now = time.monotonic()
        report.switch_s = now - started
        report.moved = len(moved)
        self._gap_watch = {rid: self._last_token_s.get(rid, now) for rid in moved if rid in self._queues}
        report.max_gap_s = 0.0
        self._gap_report = (report, None)

    def _settle_gap(self) -> None:
        """Resolve a remap's future once every moved stream has its next token (or ended)."""
        if self._gap_report is None or self._gap_watch:
            return
        report, done = self._gap_report
        self._gap_report = None
        log.warning(
            "tessel: %s: the longest gap between two tokens of a moved stream was %.2f s",
            report.reason,
            report.max_gap_s,
        )
        if done is not None:
            self._remap_done(done, report)

    def _track(self, outputs: list[Any]) -> None:
        """Note when each stream got its last token; measure the gap of the streams a switch moved."""
        if not outputs:
            return
        now = time.monotonic()
        for output in outputs:
            rid = output.request_id
            since = self._gap_watch.pop(rid, None)
            if since is not None and self._gap_report is not None:
                report = self._gap_report[0]
                report.max_gap_s = max(report.max_gap_s or 0.0, now - since)
            if output.finished:
                self._last_token_s.pop(rid, None)
            else:
                self._last_token_s[rid] = now
        if self._gap_report is not None and not self._gap_watch:
            self._settle_gap()

    def _remap_done(
        self, done: Future, report: RemapReport, error: BaseException | None = None, refused: bool = False
    ) -> None:
        with self._cond:
            self._remapping = False
        if done.done():
            return
        if refused:
            done.set_exception(error)
            return
        if error is not None:
            report.ok = False
            report.error = report.error or _describe(error)
            if not report.rolled_back:
                report.rolled_back = self.error is None  # the old pipeline never stopped
            log.error("tessel: remap (%s) failed and rolled back: %s", report.reason, report.error)
        done.set_result(report)

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
            self.rebuilding = None
        dead = EngineDeadError(f"the engine failed: {_describe(error)}{self._dead_note}")
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
