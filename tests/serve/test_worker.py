"""The model worker's hand-off to the event loop (edge.serve.worker): pieces of a real (tiny) llama.cpp
generation, the wake-ups they cost and what a cancelled consumer leaves behind."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from edge.config import ModelConfig
from edge.model.generate import GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.serve.worker import ModelWorker


@pytest.fixture(scope="module")
def model(tiny_gguf: Path) -> GGUFModel:
    m = load_gguf_model(ModelConfig(name="tiny", path=str(tiny_gguf), n_ctx=256, n_threads=1),
                        read_gguf_info(tiny_gguf))
    yield m
    m.close()


def job(m: GGUFModel, n: int = 40) -> Job:
    return Job(tokens=m.tokenize_prompt("Hello world"), params=GenParams(max_tokens=n, temperature=0))


async def pieces(worker: ModelWorker, j: Job, eager: bool) -> list[str]:
    return [p.text async for p in worker.stream(j, eager=eager)]


async def pieces_and_wakes(worker: ModelWorker, j: Job) -> tuple[list[str], int]:
    """A stream's pieces, and how often the worker's thread woke the event loop for them."""
    loop = asyncio.get_running_loop()
    wakes, real = 0, loop.call_soon_threadsafe

    def counting(*args, **kw):
        nonlocal wakes
        wakes += 1
        return real(*args, **kw)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    return [p.text async for p in worker.stream(j, eager=True)], wakes


def test_a_stream_gets_the_first_piece_at_once_and_the_rest_per_interval(model: GGUFModel) -> None:
    whole = "".join(asyncio.run(pieces(ModelWorker(model, 4), job(model), eager=False)))
    slow = ModelWorker(model, 4, stream_interval_s=3600.0)  # an interval no generation outlasts
    got, wakes = asyncio.run(pieces_and_wakes(slow, job(model)))
    # the loop is woken for the first piece and the end, never per token; what came while it was
    # busy with the first piece goes out merged when it asks again (on a loaded machine: an event)
    assert "".join(got) == whole and wakes <= 2 and 1 <= len(got) <= 3


def test_the_first_piece_carries_when_it_was_made(model: GGUFModel) -> None:
    async def first_at() -> tuple[float, float, float]:
        w = ModelWorker(model, 4)
        t0 = time.perf_counter()
        stream = w.stream(job(model, 8), eager=False)
        p = await stream.__anext__()
        t1 = time.perf_counter()
        async for _ in stream:
            pass
        return t0, p.at, t1

    t0, at, t1 = asyncio.run(first_at())
    assert t0 < at <= t1  # stamped on the generating thread, before the loop saw it


def test_a_consumer_that_goes_away_stops_the_generation(model: GGUFModel) -> None:
    async def leave_after_one() -> Job:
        w = ModelWorker(model, 4)
        j = job(model, 200)
        stream = w.stream(j, eager=True)
        await stream.__anext__()
        await stream.aclose()  # what a client's disconnect does (edge.serve.metrics closes the stream)
        assert j.cancel.is_set()
        await w.call(lambda: None)  # queued behind the generation: runs once it has stopped
        return j

    j = asyncio.run(leave_after_one())
    assert j.completion_tokens < 200


def test_a_control_call_runs_when_the_request_queue_is_full(model: GGUFModel) -> None:
    """A reload sets thread counts through control calls: a full queue must not refuse them
    (a kept model would serve on with fewer threads)."""
    from edge.errors import RequestError

    async def go() -> int:
        w = ModelWorker(model, max_queue=1)
        for _ in range(model.slots.n + 1):  # every slot taken, and the queue full
            w.admit()
        with pytest.raises(RequestError):
            await w.call(lambda: 1)
        return await w.control(lambda: 2)

    assert asyncio.run(go()) == 2


def test_a_held_worker_queues_requests_and_decodes_them_once_resumed(model: GGUFModel) -> None:
    """A handover's new process holds its models until the old one has drained
    (edge.lifecycle.handover.successor): a request is admitted and queued, calls still run, no step does."""
    async def held_then_resumed() -> tuple[list[str], bool, int, int]:
        w = ModelWorker(model, 4)
        before = w.started  # the model's count (its scheduler's), whichever worker queued them
        w.hold()
        stream = asyncio.ensure_future(pieces(w, job(model, 8), eager=True))
        for _ in range(3):  # calls run between steps, held or not: each one is a turn of the loop
            await w.control(lambda: None)
        decoded_while_held = stream.done() or model.slots.busy
        started = w.started - before
        w.resume()
        text = await stream
        w.close()
        return text, decoded_while_held, started, w.started - before

    text, decoded_while_held, started_held, started_after = asyncio.run(held_then_resumed())
    assert not decoded_while_held and started_held == 0  # queued, not started
    assert started_after == 1 and "".join(text) == "".join(asyncio.run(pieces(ModelWorker(model, 4), job(model, 8),
                                                                                    eager=True)))


def _resumed(worker: ModelWorker) -> "threading.Event":
    """Set when `worker` is resumed (its own resume() runs first)."""
    import threading

    event, real = threading.Event(), worker.resume
    worker.resume = lambda: (real(), event.set())  # type: ignore[method-assign]
    return event


def test_a_successor_holds_its_models_until_the_old_process_drained(model: GGUFModel) -> None:
    import os

    from edge.lifecycle.handover.successor import Successor

    read_end, write_end = os.pipe()
    ready_r, ready_w = os.pipe()
    worker = ModelWorker(model, 4)
    resumed = _resumed(worker)
    Successor(ready_w, read_end).hold_until_drained([worker], limit_s=300)
    assert worker._held
    assert not resumed.wait(0.05) and worker._held  # the old process has not closed its end
    os.close(write_end)  # it drained (or ended)
    assert resumed.wait(60) and not worker._held
    # no drain in time: the models decode after the limit all the same
    read2, write2 = os.pipe()
    other = ModelWorker(model, 4)
    done = _resumed(other)
    Successor(ready_w, read2).hold_until_drained([other], limit_s=0.01)
    assert done.wait(60) and not other._held
    for fd in (write2, ready_r, ready_w):
        os.close(fd)


def test_two_workers_on_one_model_decode_on_one_thread(model: GGUFModel) -> None:
    """Issue 53's `llama_decode of 1 tokens at position 17 returned -1 (invalid batch)`: a second
    ModelWorker on a model an earlier one had served (a reload's new worker on a kept model
    while the old drains, or two tests one after the other, the second job reusing 16 cached
    tokens) ran a scheduler thread of its own, and the first worker's thread, woken by any call,
    stepped the same slots too: both built a batch with the same sequence's next token at the
    same position, and the second llama_decode of it was refused. Every step of a model runs on
    its one scheduler thread now, whichever worker queued the request."""
    import threading

    threads: set[int] = set()
    real_step = model.slots.step

    def step() -> bool:
        threads.add(threading.get_ident())
        return real_step()

    async def go() -> tuple[str, str, Job]:
        first = ModelWorker(model, 4)
        whole = "".join(await pieces(first, job(model), eager=False))
        second = ModelWorker(model, 4)
        j = job(model, 60)
        stream = asyncio.ensure_future(pieces(second, j, eager=True))
        while not stream.done():  # the first worker's thread woken while the second's request decodes
            await first.control(lambda: None)
        return whole, "".join(await stream), j

    model.slots.step = step  # type: ignore[method-assign]
    try:
        whole, text, j = asyncio.run(go())
    finally:
        del model.slots.step
    assert len(threads) == 1, threads
    assert j.cached_tokens >= 16 and text.startswith(whole[:len(whole) // 2])


def test_a_token_decoded_twice_at_one_position_is_the_invalid_batch(model: GGUFModel) -> None:
    """What two threads stepping one context did: the same sequence's token at a position it
    already holds. llama.cpp refuses such a batch (-1); edge says which."""
    from edge.model.native import DecodeError

    native, prompt = model.native, model.tokenize_prompt("Hello world")
    with model.slots.spare(prompt, len(prompt) + 1) as seq:
        model.cache.reset(seq)
        native.decode(seq, prompt, 0)
        native.decode_batch([prompt[-1]], [len(prompt)], [seq], [1])
        with pytest.raises(DecodeError) as err:
            native.decode_batch([prompt[-1]], [len(prompt)], [seq], [1])
        model.cache.reset(seq)
    assert err.value.rc == -1 and "invalid batch" in str(err.value)
