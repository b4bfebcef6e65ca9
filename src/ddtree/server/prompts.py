"""A job's prompt as token ids and its sampling parameters, checked against the context and the
cache. A tokenizer is used from one thread at a time (a fast tokenizer shared across threads can
fail with "Already borrowed"): the scheduler thread's in one process; with an engine-core process
the HTTP process encodes text under EngineCore's lock, and the core checks the ids."""

from __future__ import annotations

from ..engine.pages import pages_for
from ..engine.sampling import SamplingParams
from .errors import APIError
from .jobs import Job


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def encode(engine, job: Job) -> list[int]:
    """The prompt's token ids (text and messages by the engine's tokenizer, ids checked against
    its vocabulary). Raises APIError (400) naming `prompt` or `messages`."""
    if job.messages is not None:
        ids = encode_text(engine.tokenizer, job)
    else:
        try:
            ids = engine.tokenize(job.prompt)
        except ValueError as err:  # token ids out of the vocabulary, or text without a tokenizer
            raise APIError(400, str(err), param=job.prompt_param, code="invalid_value") from None
    if not ids:
        raise APIError(400, "the prompt encodes to no tokens", param=job.prompt_param, code="invalid_value")
    return ids


def encode_text(tokenizer, job: Job) -> list[int]:
    """A job's chat messages or text prompt as token ids, by `tokenizer`, as Engine.tokenize
    encodes text. Raises APIError (400) naming `prompt` or `messages`."""
    if job.messages is None:
        if tokenizer is None:
            raise APIError(400, "the target directory has no tokenizer: pass prompts as lists of token ids",
                           param="prompt", code="invalid_value")
        return list(tokenizer(job.prompt)["input_ids"])
    try:
        text = tokenizer.apply_chat_template(job.messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja's TemplateError and whatever a template raises on bad input
        raise APIError(400, f"the chat template refused the messages: {err}", param="messages",
                       code="invalid_value") from None
    # The template writes the special tokens itself (BOS included): do not add them twice.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def sampling_params(engine, job: Job, prompt_len: int) -> SamplingParams:
    """SamplingParams with max_new_tokens checked against max_model_len and the KV cache.
    A job without max_tokens gets what is left of the context (capped by what the cache holds)."""
    context = engine.max_model_len
    if prompt_len >= context:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the context is {context} tokens "
                       "(max_model_len), which leaves no room for a completion", param=job.prompt_param,
                       code="context_length_exceeded")
    cache_rows = engine.request_capacity
    room = cache_rows - prompt_len - engine.node_limit(job.mode, job.budget)
    max_new = job.max_tokens
    if max_new is None:
        max_new = min(context - prompt_len, room)
        if max_new < 1:
            raise APIError(400, f"the prompt ({prompt_len} tokens) leaves no room in the KV cache "
                           f"({cache_rows} slots)", param=job.prompt_param, code="context_length_exceeded")
    elif prompt_len + max_new > context:
        raise APIError(400, f"prompt ({prompt_len} tokens) + {job.limit_param} ({max_new}) is over the context "
                       f"of {context} tokens (max_model_len)", param=job.limit_param,
                       code="context_length_exceeded")
    elif max_new > room:
        need = pages_for(prompt_len + max_new + engine.node_limit(job.mode, job.budget), engine.page_size)
        raise APIError(400, f"prompt ({prompt_len} tokens) + {job.limit_param} ({max_new}) needs {need} KV pages; "
                       f"the cache holds {cache_rows // engine.page_size} per request",
                       param=job.limit_param, code="context_length_exceeded")
    try:
        return SamplingParams(max_new_tokens=max_new, **job.sampling)
    except ValueError as err:  # the HTTP side checked the ranges; this is the engine's own word
        raise APIError(400, str(err), code="invalid_value") from None
