"""The checks of every HTTP request body, in one place: OpenAI's request fields in, a `Job` out.

Fields follow OpenAI's API (and vLLM's extras top_k, min_p, repetition_penalty, ignore_eos,
stop_token_ids). Unknown fields are accepted and ignored, as vLLM does, since SDKs add fields of
their own. Features the server does not have (tools, response_format with a schema, logit_bias,
suffix, echo, best_of) are refused with a 400 that names the field rather than ignored. Every
problem is an `APIError` carrying OpenAI's error shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jaxllm.engine.api import MAX_TOP_LOGPROBS, Request
from jaxllm.text.detokenize import MAX_STOP_STRINGS

INT64_MAX = 2 ** 63 - 1


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             429: "rate_limit_exceeded", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Base):
    include_usage: bool | None = False


class _Sampling(_Base):
    """Fields chat and completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-2 ** 63, le=INT64_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        return stops


class CompletionBody(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: str


class Message(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict | None = None


@dataclass
class Limits:
    """What the server allows, and what it needs to turn text into ids."""

    model: str
    tokenizer: Any
    max_context: int
    max_n: int = 8
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class Job:
    """One checked request: n engine `Request`s (one per choice) and how to answer."""

    kind: Literal["chat", "completion"]
    prompt_ids: list[int]
    requests: list[Request]
    stops: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str


def _param(err: ValidationError) -> tuple[str, str]:
    """(param, message) of pydantic's first error, in OpenAI's words."""
    e = err.errors()[0]
    param = ".".join(str(p) for p in e["loc"] if not isinstance(p, str) or not p.startswith("function-"))
    param = param or "body"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "missing":
        return param, f"'{param}' is a required field"
    return param, f"'{param}': {msg} (got {e.get('input')!r})"


def _validate(model: type[BaseModel], data: Any) -> BaseModel:
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        param, message = _param(e)
        raise APIError(400, message, param) from None


def _refuse(param: str, what: str) -> None:
    raise APIError(400, f"'{param}' is not supported by this server ({what})", param, "unsupported_parameter")


def _check_model(body: _Sampling, limits: Limits) -> None:
    if body.model != limits.model:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{limits.model}'",
                       "model", "model_not_found")


def _requests(body: _Sampling, limits: Limits, prompt: list[int], max_tokens: int | None,
              logprobs: int | None) -> list[Request]:
    if not prompt:
        raise APIError(400, "the prompt is empty: generation needs at least one token", "prompt")
    vocab = getattr(limits.tokenizer, "vocab_size", None)
    if vocab is not None and any(not 0 <= t < vocab for t in prompt):
        raise APIError(400, f"the prompt holds a token id outside [0, {vocab})", "prompt")
    room = limits.max_context - len(prompt)
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {limits.max_context} tokens. However, "
                            f"your prompt is {len(prompt)} tokens.", "messages" if hasattr(body, "messages")
                       else "prompt", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    elif len(prompt) + max_tokens > limits.max_context:
        raise APIError(400, f"This model's maximum context length is {limits.max_context} tokens. However, "
                            f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                            f"{max_tokens} for the completion).", "max_tokens", "context_length_exceeded")
    if body.n > limits.max_n:
        raise APIError(400, f"'n': at most {limits.max_n} choices, got {body.n}", "n")
    if body.logit_bias:
        _refuse("logit_bias", "no logit biases")
    stop_ids = tuple(body.stop_token_ids or ())
    if vocab is not None and any(not 0 <= t < vocab for t in stop_ids):
        raise APIError(400, f"'stop_token_ids' holds an id outside [0, {vocab})", "stop_token_ids")
    seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    base = Request(
        prompt=tuple(prompt), max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k,
        min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        seed=seed, stop_token_ids=stop_ids, ignore_eos=bool(body.ignore_eos), logprobs=logprobs)
    # choice i draws with seed + i: n different samples, each reproducible from the request's seed
    return [base.replace(seed=(seed + i + 2 ** 63) % 2 ** 64 - 2 ** 63) for i in range(body.n)]


def _job(kind, body: _Sampling, limits: Limits, prompt, max_tokens, logprobs, wants_logprobs) -> Job:
    options = body.stream_options
    if options is not None and not body.stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    return Job(kind, prompt, _requests(body, limits, prompt, max_tokens, logprobs), list(body.stop or []),
               bool(body.stream), bool(options and options.include_usage), wants_logprobs, body.model)


def completion_job(data: Any, limits: Limits) -> Job:
    """The Job of a /v1/completions body, or an APIError."""
    body = _validate(CompletionBody, data)
    _check_model(body, limits)
    if body.suffix:
        _refuse("suffix", "no fill-in-the-middle")
    if body.echo:
        _refuse("echo", "the prompt is not echoed")
    if body.best_of not in (None, 1) and body.best_of != body.n:
        _refuse("best_of", "no best-of sampling")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"'prompt': one prompt per request, got a list of {len(prompt)}", "prompt")
        prompt = prompt[0]
    ids = limits.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
    return _job("completion", body, limits, ids, body.max_tokens, body.logprobs, body.logprobs is not None)


def chat_job(data: Any, limits: Limits) -> Job:
    """The Job of a /v1/chat/completions body (its messages through the chat template), or an APIError."""
    body = _validate(ChatBody, data)
    _check_model(body, limits)
    if body.tools or body.functions:
        _refuse("tools" if body.tools else "functions", "no tool calling")
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        _refuse("response_format", f"no structured output of type {fmt!r}")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    tok = limits.tokenizer
    if tok.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    messages = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(part.text for part in m.content)
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _job("chat", body, limits, ids, max_tokens, logprobs, bool(body.logprobs))
