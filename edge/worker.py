"""One thread per loaded model or engine: native contexts are not thread-safe, so every call into
one runs on its own worker, in order, while the event loop stays free."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

__all__ = ["Worker"]


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"edge-{name}")

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
