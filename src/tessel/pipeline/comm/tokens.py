"""The sampled tokens coming back to stage 0: their wire format, and the threads that receive them.

What a path's last stage hands back for one micro-batch: the sampled tokens and, where the requests
asked, their logprobs and the prompt logprobs of its chunks (`tessel.engine.model_runner.SampledRows`,
sampled with the single-process engine's own `ModelRunner.sample_hidden`; stage 0 applies them with
the engine's own update, so a pipeline's outputs carry the same logprobs as one process's). On the
wire: int64 `[micro-batch id, payload bytes, tokens]`, the tokens (int64) when there are any, then,
only when payload bytes > 0, the pickled (logprobs, prompt logprobs) as uint8.

Stage 0 computes its own layers between receiving tokens: without a thread the tokens of a
micro-batch that came back while it computed would wait in the socket until the engine blocks for
them, after it has launched every idle slot (seconds, behind long prefills). So one thread per
stage that samples (`TokenReceiver`) takes them off the wire as they come, and the engine takes
what has arrived before each launch: a request's first token is out, and its slot free again, as
soon as stage 0 is between two micro-batches. Each thread receives on a process group of its own
(stage 0 and that stage, gloo), so it never shares a gloo pair with the main thread's sends. It is
told how many micro-batches it is owed (`expect`) and receives exactly those; they come in the
order that stage computed them, which for a stage several paths end on is not launch order, so they
are kept by micro-batch id. A failed receive is kept too, and raised by the engine's next `take`.
"""

from __future__ import annotations

import pickle
import queue
import threading

import torch
import torch.distributed as dist

from tessel.engine.model_runner import SampledRows

HEAD_LEN = 3  # micro-batch id, payload bytes, tokens


def to_wire(sampled: SampledRows, batch_id: int) -> tuple[torch.Tensor, ...]:
    """The tensors to send: the head, the tokens if any, the logprobs payload if any."""
    payload = pickle.dumps((sampled.logprobs, sampled.prompt_logprobs)) if sampled.has_logprobs else b""
    tensors = [torch.tensor([batch_id, len(payload), len(sampled.tokens)], dtype=torch.int64)]
    if sampled.tokens:
        tensors.append(torch.tensor(sampled.tokens, dtype=torch.int64))
    if payload:
        tensors.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return tuple(tensors)


def from_wire(tokens: list[int], payload: bytes) -> SampledRows:
    if not payload:
        return SampledRows(tokens)
    logprobs, prompt_logprobs = pickle.loads(payload)
    if len(logprobs) != len(tokens):
        raise ValueError(f"{len(logprobs)} logprob entries for {len(tokens)} tokens")
    return SampledRows(tokens, logprobs, prompt_logprobs)


class TokenReceiver:
    """Receives from `source` on `group` (a gloo group of stage 0 and `source`) as many micro-batches'
    tokens as it is owed, keeping each by its micro-batch id."""

    def __init__(self, source: int, group) -> None:  # noqa: ANN001 (a torch.distributed group)
        self.source, self.group = source, group
        self._owed: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self._arrived: dict[int, SampledRows] = {}
        self._failure: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"tessel-tokens-{source}", daemon=True)
        self._thread.start()

    def expect(self) -> None:
        """One more micro-batch's tokens will come from `source`."""
        self._owed.put(True)

    def ready(self, batch_id: int) -> bool:
        """Whether micro-batch `batch_id`'s tokens are here (`take` will not wait)."""
        with self._cond:
            return batch_id in self._arrived or self._failure is not None

    def take(self, batch_id: int) -> SampledRows:
        """Micro-batch `batch_id`'s tokens; waits for them. Raises what failed the receive (a
        RuntimeError of the process group)."""
        with self._cond:
            while batch_id not in self._arrived and self._failure is None:
                self._cond.wait()
            if batch_id in self._arrived:
                return self._arrived.pop(batch_id)
            raise self._failure

    def abort(self, error: BaseException) -> None:
        """Stop waiting: a `take` that has no tokens yet raises `error` (a stage known lost, whose
        link may be cut so that its receive never fails by itself)."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread once what is owed has been received."""
        self._owed.put(None)
        self._thread.join()

    def _run(self) -> None:
        while self._owed.get() is not None:
            try:
                batch_id, rows = self._receive()
            except (RuntimeError, ValueError) as error:
                with self._cond:
                    self._failure = error
                    self._cond.notify_all()
                return
            with self._cond:
                self._arrived[batch_id] = rows
                self._cond.notify_all()

    def _receive(self) -> tuple[int, SampledRows]:
        head = torch.empty(HEAD_LEN, dtype=torch.int64)
        dist.recv(head, self.source, group=self.group)
        batch_id, size, count = head.tolist()
        tokens = torch.empty(count, dtype=torch.int64)
        if count:
            dist.recv(tokens, self.source, group=self.group)
        payload = b""
        if size:
            blob = torch.empty(size, dtype=torch.uint8)
            dist.recv(blob, self.source, group=self.group)
            payload = blob.numpy().tobytes()
        return batch_id, from_wire(tokens.tolist(), payload)
