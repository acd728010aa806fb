"""Stage 0's receiver of sampled tokens: a thread that takes each owed micro-batch's tokens off the
wire as soon as the last stage sends them.

Stage 0 computes its own layers between receiving tokens: without this thread the tokens of a
micro-batch that came back while it computed wait in the socket until the engine blocks for them,
after it has launched every idle slot (seconds, behind long prefills). With it, the engine takes
what has arrived before each launch (`PipelineEngine._launch`): a request's first token is out, and
its slot free again, as soon as stage 0 is between two micro-batches.

The thread receives on a process group of its own (stage 0 and the last stage, gloo), so it never
shares a gloo pair with the main thread's sends. It is told what is owed in launch order (the last
stage computes and answers micro-batches in that order), receives `[batch id, payload bytes,
tokens...]` and the payload (`tessel.pipeline.sampled`), and hands them over in that order. A
failed receive is handed over too, and raised by the engine's next `take`.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from tessel.pipeline.sampled import HEAD_LEN


class TokenReceiver:
    def __init__(self, source: int, group) -> None:  # noqa: ANN001 (a torch.distributed group)
        self.source, self.group = source, group
        self._owed: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # rows sampled, per micro-batch
        self._arrived: queue.SimpleQueue[tuple[list[int], bytes] | BaseException] = queue.SimpleQueue()
        self._failure: RuntimeError | None = None
        self._thread = threading.Thread(target=self._run, name="tessel-tokens", daemon=True)
        self._thread.start()

    def expect(self, count: int) -> None:
        """The next micro-batch launched samples `count` rows."""
        self._owed.put(count)

    def ready(self) -> bool:
        """Whether the oldest owed micro-batch's tokens are here (`take` will not wait)."""
        return not self._arrived.empty()

    def take(self) -> tuple[list[int], bytes]:
        """The oldest owed micro-batch's `[batch id, payload bytes, tokens...]` and payload; waits
        for them. Raises what failed the receive (a RuntimeError of the process group)."""
        if self._failure is not None and self._arrived.empty():
            raise self._failure  # the thread has stopped: nothing more will come
        item = self._arrived.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop the thread once what is owed has been received."""
        self._owed.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (count := self._owed.get()) is not None:
            try:
                head = torch.empty(HEAD_LEN + count, dtype=torch.int64)
                dist.recv(head, self.source, group=self.group)
                values = head.tolist()
                payload = b""
                if values[1]:
                    blob = torch.empty(values[1], dtype=torch.uint8)
                    dist.recv(blob, self.source, group=self.group)
                    payload = blob.numpy().tobytes()
            except RuntimeError as error:
                self._failure = error
                self._arrived.put(error)
                return
            self._arrived.put((values, payload))
