"""OpenAI-style errors: the exception the server raises, its JSON body, and the request body reader
(size limit, UTF-8, JSON object) whose failures are such errors.

Every 4xx / 5xx the server sends has the body OpenAI's API sends:
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError



class APIError(Exception):
    """An error answered to one request: status (int), message (str), param (the offending field
    as OpenAI names it, e.g. "max_tokens" or "messages[0].content", or None), code (str | None)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def __reduce__(self):  # pickled whole: the engine-core process sends its errors to the HTTP process
        return type(self), (self.status, self.message), {"param": self.param, "code": self.code, "headers": self.headers}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"  # OpenAI's two types
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error(request_id: str) -> APIError:
    """The 500 a request gets when the server failed it; the log holds the traceback under its id."""
    return APIError(500, f"internal error while serving request {request_id}; the server log has the details",
                    code="internal_error")


def _is_type_tag(part: str) -> bool:
    """pydantic puts union member names in error locations ('str', 'list[int]', 'TextPart'); they
    are not fields. Our fields are lower-case identifiers."""
    return not part.isidentifier() or not part.islower() or part in {"str", "int", "float", "bool", "list", "dict"}


def param_of(loc: tuple) -> str | None:
    """An error location as OpenAI names parameters: ("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_type_tag(part):
            out += f".{part}" if out else part
    return out or None


def validation_error(err: ValidationError) -> APIError:
    """The 400 for a body pydantic refused: the first offending field, all of its messages."""
    errors = err.errors(include_url=False)
    param = param_of(errors[0]["loc"])
    messages = []
    for e in errors:
        msg = e["msg"].removeprefix("Value error, ")
        if param_of(e["loc"]) == param and msg not in messages:
            messages.append(msg)
    if errors[0]["type"] == "extra_forbidden":
        text = f"unknown field '{param}' (not supported by this server)"
    elif errors[0]["type"] == "missing":
        text = f"'{param}' is required"
    else:
        text = f"invalid '{param}': " + "; or ".join(messages)
    return APIError(400, text, param=param, code="invalid_value" if errors[0]["type"] != "extra_forbidden"
                    else "unknown_parameter")


async def read_json(request: Request, limit: int, timeout_s: float | None = None) -> dict:
    """The request body as a JSON object, read at most `limit` bytes far, within `timeout_s`.
    Raises APIError: 413 over the limit, 408 when the body has not arrived in time (a slow client
    holds nothing of the engine's meanwhile: requests are queued once their body is read), 400 for
    bytes that are not UTF-8, invalid JSON, a non-object, or strings that cannot be encoded (lone
    surrogates)."""
    length = request.headers.get("content-length", "")
    too_big = APIError(413, f"the request body is over the server's limit of {limit} bytes", code="request_too_large")
    if length.isdigit() and int(length) > limit:
        raise too_big

    async def receive() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():  # stop reading as soon as the limit is passed
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start})",
                       code="invalid_encoding") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    bad = _unencodable(body, "")  # "\ud800" is valid JSON, but no tokenizer can encode it
    if bad is not None:
        raise APIError(400, f"'{bad or 'body'}' holds a string that is not valid Unicode (a lone surrogate)",
                       param=bad or None, code="invalid_encoding")
    return body


def _unencodable(value, path: str) -> str | None:
    """The path of the first string (key or value) in a JSON value that UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _unencodable(key, path) is not None:
            return path  # the name itself is bad: name its parent, never echo the name
        sub = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found = _unencodable(item, sub)
        if found is not None:
            return found
    return None
