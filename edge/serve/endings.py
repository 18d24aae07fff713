"""How a request ends when its process does, not its client: passed on whole to a handover's new
process (the PASSED_ON head, which edge.lifecycle.handover.pass_on takes; `DeferredStream`, whose
head waits for its request to leave the queue, so that a queued stream can still be), or ended by
the drain's limit (a 503, or a stream's final error event: `server_ended` says so in the log)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from starlette.responses import Response, StreamingResponse

from edge.serve.openai_shapes import Shape
from edge.serve.worker import SERVER_ENDED, ModelWorker, PassedOn

__all__ = ["PASSED_ON", "DeferredStream", "pass_instead", "passed_on", "server_ended"]

log = logging.getLogger(__name__)

# The head of a request passed on (PassedOn): a 307 ("answered elsewhere", as /metrics counts it)
# that the lifecycle's pass-on layer takes, never a client.
PASSED_ON = (b"x-edge-passed-on", b"1")


def passed_on() -> Response:
    return Response(status_code=307, headers={PASSED_ON[0].decode(): PASSED_ON[1].decode()})


def pass_instead(workers: Iterable[ModelWorker], exc: BaseException) -> bool:
    """A request the drain's limit ended before any byte of its answer was sent, in a handover's
    old process (its workers pass on): passed on to the new process, to start again there,
    rather than answered 503."""
    return getattr(exc, "code", None) == SERVER_ENDED and any(w.passes_on for w in workers)


class DeferredStream(StreamingResponse):
    """An SSE stream whose head goes out with its first chunk (edge's `_sse` yields none while
    its request is queued): a request passed on before that (PassedOn) is answered with the
    PASSED_ON head instead, which the lifecycle takes."""

    async def stream_response(self, send: Any) -> None:
        chunks = self.body_iterator.__aiter__()
        try:
            first = await chunks.__anext__()
        except PassedOn:
            resp = passed_on()
            await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def server_ended(shape: Shape, tokens: int, streamed: bool) -> None:
    """One line for a request the drain's limit ended (not a client's 499)."""
    log.info("status 503 (ended by the server: draining past server.drain_timeout_s): %s for model %r%s; "
             "%d completion tokens generated", "chat completion" if shape.chat else "completion", shape.model,
             ", mid-stream" if streamed else "", tokens)
