"""The HTTP side of one generation request: submit the job, wait for the engine's verdict, then
stream its chunks as server-sent events or collect them into one response.

A client that disconnects has its request aborted: while the response is not started, a watcher
on the ASGI receive channel sees the disconnect; once streaming, Starlette cancels the stream and
the generator's `finally` aborts. Either way the scheduler drops it before the next round.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .errors import APIError, internal_error
from .jobs import Chunk, Failed, Job
from .protocol import StreamOptions
from .responses import ResponseShape, sse
from .scheduler import QueueFull

log = logging.getLogger("ddtree.server")
_GONE = object()  # the client disconnected
CLIENT_CLOSED = 499  # nginx's status for a request the client abandoned (counted, never sent)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read, so only http.disconnect comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next(handle, watcher: asyncio.Task):
    """The handle's next event, or _GONE if the client disconnects first."""
    get = asyncio.ensure_future(handle.next())
    done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()  # asyncio.Queue.get is cancellation-safe: no event is lost
    return _GONE


async def generate(request: Request, state, job: Job, kind: str, stream: bool,
                   options: StreamOptions | None) -> Response:
    """Serve one job end to end; returns the response (an error body for 4xx / 5xx)."""
    endpoint = request.url.path
    metrics, scheduler = state.metrics, state.scheduler
    try:
        handle = scheduler.submit(job, asyncio.get_running_loop())
    except QueueFull as err:
        metrics.requests.labels(endpoint, "503").inc()
        return APIError(503, f"the server is at capacity ({err}); retry later", code="queue_full",
                        headers={"Retry-After": str(state.config.retry_after_s)}).response()
    except RuntimeError as err:
        metrics.requests.labels(endpoint, "503").inc()
        return APIError(503, str(err), code="shutting_down").response()
    shape = ResponseShape(kind, job.request_id, state.config.model_name)
    watcher = asyncio.ensure_future(_disconnected(request))
    status = 500
    try:
        event = await _next(handle, watcher)
        if event is _GONE:
            scheduler.abort(job.request_id)
            status = CLIENT_CLOSED
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(event, Failed):
            status = event.error.status
            return event.error.response()
        if stream:
            watcher.cancel()  # from here Starlette's StreamingResponse watches for the disconnect
            status = None  # counted by the stream itself
            return StreamingResponse(_stream(handle, shape, options or StreamOptions(), state, endpoint),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})
        texts = []
        while True:
            event = await _next(handle, watcher)
            if event is _GONE:
                scheduler.abort(job.request_id)
                status = CLIENT_CLOSED
                return Response(status_code=CLIENT_CLOSED)
            if isinstance(event, Failed):
                status = event.error.status
                return event.error.response()
            texts.append(event.text)
            if event.finish_reason is not None:
                status = 200
                return JSONResponse(shape.full("".join(texts), event.finish_reason, event.usage),
                                    headers={"X-Request-Id": job.request_id})
    except Exception:
        log.exception("request %s: failed in the HTTP handler", job.request_id)
        scheduler.abort(job.request_id)
        status = 500
        return internal_error(job.request_id).response()
    finally:
        watcher.cancel()
        if status is not None:
            metrics.requests.labels(endpoint, str(status)).inc()


async def _stream(handle, shape: ResponseShape, options: StreamOptions, state, endpoint: str):
    """Server-sent events: one per committed chunk, the usage chunk if asked, then [DONE]. An error
    after the stream started is sent as an `error` event (its status is counted)."""
    status, done = CLIENT_CLOSED, False
    try:
        if shape.kind == "chat":
            yield sse(shape.chunk("", role=True))
        while True:
            event = await handle.next()
            if isinstance(event, Failed):
                status, done = event.error.status, True
                yield sse(event.error.body())
                break
            assert isinstance(event, Chunk)
            if event.text or event.finish_reason is not None:
                usage = event.usage if options.continuous_usage_stats else None
                yield sse(shape.chunk(event.text, event.finish_reason, usage))
            if event.finish_reason is not None:
                status, done = 200, True
                if options.include_usage:
                    yield sse(shape.usage_chunk(event.usage))
                break
        yield sse("[DONE]")
    except Exception:  # a bug while writing this stream: fail it alone
        log.exception("request %s: failed while streaming", handle.request_id)
        status = 500
        yield sse(internal_error(handle.request_id).body())
    finally:
        if not done:  # cancelled (the client went away) or failed: free its slot and pages
            state.scheduler.abort(handle.request_id)
        state.metrics.requests.labels(endpoint, str(status)).inc()
