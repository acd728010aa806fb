"""Racing a request's work against its client leaving (both the server and the replica router)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """(True, None) if the client left before `work` finished (then cancelled, and waited for),
    else (False, its result)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return True, None
    return False, task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
