"""The request bodies the server accepts, as pydantic models: OpenAI's fields, strictly typed.

Unknown fields are refused (extra="forbid") and types are strict ("5" is not an int, 1 is not a
bool), so a typo or a wrong type is a 400 naming the field instead of a silently ignored setting.
OpenAI fields whose feature the engine lacks (logprobs, penalties, n > 1, tools...) are accepted in
their neutral value and refused with a clear 400 otherwise (`unsupported`). Extensions, as in
vLLM: `top_k`, `ignore_eos`, and `ddtree: {mode, budget}` (budget a number or "auto").
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.sampling import MAX_SEED
from .errors import APIError

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 256


class DDTreeOptions(BaseModel):
    """Per-request decoding mode and tree budget: nodes per round, or "auto" (the engine chooses
    each round); server defaults when absent."""

    model_config = STRICT
    mode: Literal["ar", "chain", "ddtree"] | None = None
    budget: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None


class StreamOptions(BaseModel):
    """include_usage: a last chunk with the usage; continuous_usage_stats: usage on every chunk."""

    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = STRICT
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no top-k cut
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    ddtree: DDTreeOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if not all(stops) or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be non-empty and at most {MAX_STOP_CHARS} characters")
        return stops

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def unsupported(self) -> APIError | None:
        """The first field asking for what this server does not do, as a 400 naming it."""
        def refuse(param: str, what: str) -> APIError:
            return APIError(400, f"'{param}': {what} is not supported by this server", param=param,
                            code="unsupported_value")

        if (self.n or 1) > 1:
            return refuse("n", "n > 1 (one choice per request)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return refuse(name, "a non-zero penalty")
        if self.logit_bias:
            return refuse("logit_bias", "a logit bias")
        if self.stream_options is not None and not self.stream:
            return APIError(400, "'stream_options' is only allowed with stream: true", param="stream_options",
                            code="invalid_value")
        return None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt, a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    suffix: str | None = None
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"one prompt per request, got {len(value)} (batched prompts are not supported)")
            value = value[0]
        if len(value) == 0:
            raise ValueError("the prompt is empty")
        return value

    def unsupported(self) -> APIError | None:
        found = super().unsupported()
        checks = [("suffix", self.suffix is not None, "a suffix"), ("echo", bool(self.echo), "echo"),
                  ("logprobs", self.logprobs is not None, "logprobs"),
                  ("best_of", (self.best_of or 1) > 1, "best_of > 1")]
        for param, bad, what in checks:
            if found is None and bad:
                found = APIError(400, f"'{param}': {what} is not supported by this server", param=param,
                                 code="unsupported_value")
        return found


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict:
        """The message as chat templates read it: role and text content."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def limit(self) -> int | None:
        """The completion's token limit (max_completion_tokens wins over the older max_tokens)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> APIError | None:
        found = super().unsupported()
        fmt = self.response_format.type if self.response_format is not None else "text"
        checks = [("logprobs", bool(self.logprobs), "logprobs"), ("top_logprobs", bool(self.top_logprobs), "logprobs"),
                  ("response_format", fmt != "text", f"response_format {fmt!r}"),
                  ("tools", bool(self.tools), "tool calling"),
                  ("tool_choice", self.tool_choice not in (None, "none"), "tool calling")]
        for param, bad, what in checks:
            if found is None and bad:
                found = APIError(400, f"'{param}': {what} is not supported by this server", param=param,
                                 code="unsupported_value")
        return found
