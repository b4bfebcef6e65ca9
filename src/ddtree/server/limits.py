"""What an operator caps: the size of one request, the streams at once, and how long anything may
take (`ddtree serve --max-tokens-limit ...`; None: no cap)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import APIError


@dataclass(frozen=True)
class Limits:
    """max_tokens: a request asking more is a 400, one asking nothing (chat: the rest of the
    context) gets this many; max_prompt_tokens: a longer prompt is a 400; max_streams: streamed
    responses open at once, past it 429 + Retry-After; request_timeout_s: from acceptance to the
    last token, then the request is aborted (its pages freed) and answered 504 or, mid-stream, with
    an error event; body_timeout_s: to receive a request body (408 after); send_timeout_s: a stream
    whose client reads nothing this long is aborted."""

    max_tokens: int | None = None
    max_prompt_tokens: int | None = None
    max_streams: int | None = None
    request_timeout_s: float | None = None
    body_timeout_s: float = 30.0
    send_timeout_s: float = 30.0

    def __post_init__(self):
        for name in ("max_tokens", "max_prompt_tokens", "max_streams", "request_timeout_s", "body_timeout_s",
                     "send_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"limit {name} must be > 0, got {value!r}")

    def max_tokens_for(self, asked: int | None, param: str) -> int | None:
        """The max_tokens a request gets: what it asked (None: the rest of the context), refused
        over the cap, the cap when it asked nothing."""
        cap = self.max_tokens
        if cap is None:
            return asked
        if asked is None:
            return cap
        if asked > cap:
            raise APIError(400, f"{param} ({asked}) is over this server's limit of {cap} tokens per request "
                           "(--max-tokens-limit)", param=param, code="invalid_value")
        return asked

    def check_prompt(self, tokens: int, param: str) -> None:
        cap = self.max_prompt_tokens
        if cap is not None and tokens > cap:
            raise APIError(400, f"the prompt has {tokens} tokens; this server takes at most {cap} "
                           "(--max-prompt-tokens)", param=param, code="context_length_exceeded")
