"""The HTTP side of one generation request: submit the job, wait for the engine's verdict, then
stream its chunks as server-sent events or collect them into one response.

A client that disconnects has its request aborted: a watcher on the ASGI receive channel sees the
disconnect, before the response starts and while it streams; a stream is also aborted when its
response ends in any other way (a failed send, a cancellation, the body never iterated), from the
response's own `finally`. Either way the scheduler drops it before the next round. A client that
reads nothing of its stream for Limits.send_timeout_s is treated as gone. Streams open at once
are capped by Limits.max_streams (429 past it).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from .errors import APIError, internal_error
from .jobs import Accepted, Chunk, Failed, Job
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


def _watch(request: Request, handle) -> asyncio.Task:
    """The disconnect watcher: a task that returns when the client has gone, and then puts _GONE
    behind the events in the handle's queue (so that a stream waits on its queue alone: no task
    and no asyncio.wait per event)."""
    watcher = asyncio.ensure_future(_disconnected(request))

    def gone(task: asyncio.Task) -> None:
        if task.cancelled():
            return  # the response ended first
        task.exception()  # retrieved: a receive that failed also means the client is gone
        handle.queue.put_nowait(_GONE)

    watcher.add_done_callback(gone)
    return watcher


async def generate(request: Request, state, job: Job, kind: str, stream: bool,
                   options: StreamOptions | None) -> Response:
    """Serve one job end to end; returns the response (an error body for 4xx / 5xx)."""
    endpoint = request.url.path
    metrics, scheduler, limits = state.metrics, state.scheduler, state.config.limits
    if stream and limits.max_streams is not None and state.streams >= limits.max_streams:
        metrics.count_request(endpoint, "429")
        share = " (this API server's share of it)" if state.config.metadata.get("api_servers") else ""
        return APIError(429, f"{state.streams} streams are open, this server's limit (--max-streams){share}; retry "
                        "later",
                        code="too_many_streams", headers={"Retry-After": str(state.config.retry_after_s)}).response()
    try:
        handle = scheduler.submit(job, asyncio.get_running_loop())
    except QueueFull as err:
        metrics.count_request(endpoint, "503")
        return APIError(503, f"the server is at capacity ({err}); retry later", code="queue_full",
                        headers={"Retry-After": str(state.config.retry_after_s)}).response()
    except RuntimeError as err:
        metrics.count_request(endpoint, "503")
        return APIError(503, str(err), code="shutting_down").response()
    except APIError as err:  # an engine-core server encodes the prompt here: text it cannot encode
        metrics.count_request(endpoint, str(err.status))
        return err.response()
    shape = ResponseShape(kind, job.request_id, state.config.model_name)
    watcher = _watch(request, handle)
    status, texts = 500, []
    if stream:
        state.streams += 1  # from here until the stream (or this function, if it never starts) closes
    try:
        while True:  # Accepted or Failed first, then the chunks
            event = await handle.next()
            if event is _GONE:
                scheduler.abort(job.request_id)
                status = CLIENT_CLOSED
                return Response(status_code=CLIENT_CLOSED)
            if isinstance(event, Failed):
                status = event.error.status
                return event.error.response()
            if isinstance(event, Accepted):
                if not stream:
                    continue
                # from here the stream owns the watcher, the abort and the count, whatever happens
                stream_ = _Stream(handle, shape, options or StreamOptions(), state, endpoint, watcher)
                status, watcher = None, None
                return _ClosingStream(stream_.events(), stream_.close, limits.send_timeout_s,
                                      media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})
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
        if watcher is not None:
            watcher.cancel()
        if status is not None:
            metrics.count_request(endpoint, str(status))
            if stream:
                state.streams -= 1  # the stream never started: it is not _Stream's to close


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends: sent in full, the client gone
    mid-stream, or gone before the body's first iteration (then an async generator's own `finally`
    never runs, since it never started). A send the client does not take within `send_timeout_s`
    (its socket buffers full: it reads nothing) ends it as if the client had gone. HTTP only."""

    def __init__(self, content, on_close, send_timeout_s: float, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close, self._send_timeout_s = on_close, send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        async def timed_send(message) -> None:
            try:
                await asyncio.wait_for(send(message), self._send_timeout_s)
            except asyncio.TimeoutError:
                log.info("a stream's client read nothing for %g s; aborting it", self._send_timeout_s)
                raise OSError("the client stopped reading its stream") from None

        try:
            # Starlette's way for ASGI 2.4 servers, whatever the server's version: without its
            # listener task per response (the request's watcher, _watch, sees the disconnect)
            await self.stream_response(timed_send)
        except OSError:
            raise ClientDisconnect() from None
        finally:
            self._on_close()


class _Stream:
    """One streamed request after its Accepted: the server-sent events, and `close`, which aborts
    the request unless it ended and counts its status (once)."""

    def __init__(self, handle, shape: ResponseShape, options: StreamOptions, state, endpoint: str,
                 watcher: asyncio.Task):
        self.handle, self.shape, self.options, self.state, self.endpoint = handle, shape, options, state, endpoint
        self.watcher = watcher  # the disconnect watcher, alive until close: a queued request is
        self.status, self.done, self.closed = CLIENT_CLOSED, False, False  # aborted while waiting too

    async def events(self):
        """One event per committed chunk, the usage chunk if asked, then [DONE]. An error after the
        stream started is sent as an `error` event (its status is counted)."""
        shape, options = self.shape, self.options
        try:
            if shape.kind == "chat":
                yield sse(shape.chunk("", role=True))
            while True:
                event = await self.handle.next()
                if event is _GONE:
                    return  # close() aborts it
                if isinstance(event, Failed):
                    self.status, self.done = event.error.status, True
                    yield sse(event.error.body())
                    break
                assert isinstance(event, Chunk)
                event = self.handle.coalesce(event)  # what a slow reader let pile up: one event
                if event.text or event.finish_reason is not None:
                    usage = event.usage if options.continuous_usage_stats else None
                    yield shape.chunk_event(event.text, event.finish_reason, usage)
                if event.finish_reason is not None:
                    self.status, self.done = 200, True
                    if options.include_usage:
                        yield sse(shape.usage_chunk(event.usage))
                    break
            yield sse("[DONE]")
        except Exception:  # a bug while writing this stream: fail it alone
            log.exception("request %s: failed while streaming", self.handle.request_id)
            self.status, self.done = 500, False
            yield sse(internal_error(self.handle.request_id).body())
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.state.streams -= 1
        self.watcher.cancel()
        if not self.done:  # the client went away, or a bug: free its slot and pages
            self.state.scheduler.abort(self.handle.request_id)
        self.state.metrics.count_request(self.endpoint, str(self.status))
