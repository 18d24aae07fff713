"""The one-request-at-a-time workers: one thread per loaded model or engine.

Native contexts (llama.cpp, TensorRT, ONNX Runtime) are not thread-safe, so every call into one
runs on its own worker thread, in order, while the event loop stays free. A bounded queue turns
overload into a clear 503 instead of unbounded latency.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from edge.errors import RequestError

if TYPE_CHECKING:  # types only: importing the worker module stays free of the backends
    from edge.engines.runtime import EngineSession
    from edge.engines.store import StoredEngine
    from edge.llm import GGUFModel, Job, Piece

__all__ = ["Worker", "ModelWorker", "EngineWorker"]


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"edge-{name}")

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ModelWorker(Worker):
    """Runs one model's jobs on its own thread, in order, with a bounded queue."""

    def __init__(self, model: GGUFModel, max_queue: int) -> None:
        super().__init__(model.cfg.name)
        self.model = model
        self.max_queue = max_queue

    def admit(self) -> None:
        """Take a place in the queue, or refuse with 503 -- before any response byte is sent."""
        if self.pending >= self.max_queue:
            raise RequestError(f"model {self.model.cfg.name!r} has {self.pending} requests queued "
                               f"(max_queue = {self.max_queue}); retry later", status=503,
                               code="server_busy")
        self.pending += 1

    def release(self) -> None:
        self.pending -= 1

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A call on the model's thread (tokenizing a request) waits in the same bounded queue
        as generations: a flood of long prompts is a 503, not a wait for everyone."""
        self.admit()
        try:
            return await super().call(fn, *args)
        finally:
            self.release()

    async def stream(self, job: Job, admitted: bool = False) -> AsyncIterator[Piece]:
        """Pieces of one generation; cancelling the consumer stops generation at the next token.
        `admitted`: the caller holds a place taken with admit() and releases it itself."""
        if not admitted:
            self.admit()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

        def run() -> None:
            end: BaseException | None = None
            try:
                # a job whose client left while it was queued is not even prefilled
                job.prefilled = not job.cancel.is_set()
                pieces = self.model.generate(job) if job.prefilled else iter(())
                for piece in pieces:
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
                    if job.cancel.is_set():
                        break
            except BaseException as exc:
                end = exc
            loop.call_soon_threadsafe(queue.put_nowait, end)

        try:
            fut = loop.run_in_executor(self._pool, run)
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
            await fut
        finally:
            job.cancel.set()
            if not admitted:
                self.release()


class EngineWorker(Worker):
    """One engine's thread: its session is created, called and closed there (a CUDA context is
    current per thread)."""

    session: EngineSession

    def __init__(self, name: str, stored: StoredEngine) -> None:
        super().__init__(name)
        self.stored = stored

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.pending += 1  # queued or running: the queue depth that /metrics shows
        try:
            return await super().call(fn, *args)
        finally:
            self.pending -= 1

    def open(self, data: bytes,
             make: Callable[[StoredEngine, bytes], EngineSession] | None = None) -> EngineSession:
        if make is None:
            from edge.engines.runtime import session_from_engine as make

        self.session = self._pool.submit(make, self.stored, data).result()
        return self.session

    def close(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            self._pool.submit(session.close).result()  # GPU objects go on the thread that made them
        super().close()
