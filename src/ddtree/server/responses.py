"""OpenAI response bodies and stream chunks for one request, completion or chat."""

from __future__ import annotations

import json
import time

from .jobs import Usage


class ResponseShape:
    """Builds the JSON of one request's response. kind: "completion" (object text_completion,
    choices[].text) or "chat" (chat.completion / chat.completion.chunk, choices[].message / delta)."""

    def __init__(self, kind: str, request_id: str, model: str):
        self.kind, self.id, self.model, self.created = kind, request_id, model, int(time.time())
        self._event_head: str | None = None  # chunk_event's JSON up to the text (or the chat delta)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict:
        """The non-streamed response."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage.as_dict()}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage.as_dict()}

    def chunk(self, text: str, finish_reason: str | None = None, usage: Usage | None = None,
              role: bool = False) -> dict:
        """One streamed event's choice: the committed text, finish_reason on the last one; usage
        when the client asked for it on every chunk; role: the chat stream's opening delta."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if usage is not None:
            body["usage"] = usage.as_dict()
        return body

    def chunk_event(self, text: str, finish_reason: str | None = None, usage: Usage | None = None) -> bytes:
        """sse(self.chunk(text, finish_reason, usage)), byte for byte, from a head rendered once per
        request: a stream sends one per round, and its head never changes."""
        if self._event_head is None:  # chunk()'s keys, in its order
            chat = self.kind == "chat"
            obj = "chat.completion.chunk" if chat else "text_completion"
            self._event_head = (f'{{"id":{_dumps(self.id)},"object":"{obj}","created":{self.created},'
                                f'"model":{_dumps(self.model)},"choices":[{{"index":0,"{"delta" if chat else "text"}":')
        if self.kind == "chat":
            delta = '{"content":' + _dumps(text) + "}" if text else "{}"
            choice = self._event_head + delta
        else:
            choice = self._event_head + _dumps(text)
        tail = ',"logprobs":null,"finish_reason":' + ("null" if finish_reason is None else _dumps(finish_reason)) + "}]"
        if usage is not None:
            tail += ',"usage":' + _dumps(usage.as_dict())
        return f"data: {choice}{tail}}}\n\n".encode("utf-8")

    def usage_chunk(self, usage: Usage) -> dict:
        """The closing chunk of stream_options.include_usage: no choices, the final usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage.as_dict()}


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # one, not one per json.dumps call


def _dumps(value) -> str:
    return _ENCODER.encode(value)


def sse(body: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`data: [DONE]` for the end)."""
    data = body if isinstance(body, str) else _dumps(body)
    return f"data: {data}\n\n".encode("utf-8")
