"""OpenAI's wire format: requests read and checked, responses and stream chunks built, stop
strings held back. Pure logic (no torch, no HTTP): every rule here is testable alone.

What fmoe cannot do exactly is refused with a 400 that says so (n > 1, tools, logprobs,
penalties, logit bias, JSON mode), never silently ignored. Fields it has no use for and
that change nothing (`user`, `metadata`, `store`, …) are accepted and ignored.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fmoe_cli.types import REPETITION_PENALTY_RANGE, SEED_RANGE

MAX_STOPS = 16  # stop strings per request (OpenAI allows 4; more cost nothing here)
MAX_DEPTH = 32  # nesting of a request body's arrays and objects (OpenAI's requests need 5; json's recursion stops near 1000)


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- requests -----------------------------------------------------------------


def decode_body(raw: bytes | bytearray) -> object:
    """A request body as JSON, or a 400 that says what is wrong with it: not UTF-8, not JSON (NaN and
    Infinity are not JSON; nor is an integer of more than 4300 digits), nested deeper than MAX_DEPTH,
    or a string holding half of a UTF-16 surrogate pair (no tokenizer takes one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8: {exc}") from None
    try:
        value = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:  # JSONDecodeError, a constant, an integer too long to read
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    _check_value(value)
    return value


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON value")


def _check_value(value: object) -> None:
    """Depth within MAX_DEPTH and every string (keys too) encodable as UTF-8; iterative, linear in the body."""
    if not isinstance(value, (dict, list)):
        _check_text(value)
        return
    pending = [(value, 1)]
    while pending:
        container, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep")
        for child in itertools.chain(container, container.values()) if isinstance(container, dict) else container:
            if isinstance(child, (dict, list)):
                pending.append((child, depth + 1))
            else:
                _check_text(child)


def _check_text(value: object) -> None:
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                                "without its pair): it is not text") from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: ignored (as OpenAI's own SDKs add some)


class TextPart(_Strict):
    type: str
    text: str | None = None


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """The options chat and text completions share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # (vLLM's and llama.cpp's servers' extension; 0 or -1: off)
    min_p: float | None = Field(default=None, ge=0, le=1)  # (the same)
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_RANGE[0],
                                             le=REPETITION_PENALTY_RANGE[1])  # (the same; 1: off)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    logprobs: Any = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, "n > 1 is not supported: fmoe answers one choice per request (send the request "
                                "again, with another seed, for another answer)", param="n")
        if self.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise ApiError(400, "a stop string must not be empty", param="stop")
        return tuple(stops)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    function_call: Any = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools or self.functions or self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            raise ApiError(400, "tools and function calling are not supported", param="tools")
        if self.top_logprobs:
            raise ApiError(400, "logprobs are not supported", param="top_logprobs")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format other than text (JSON mode, schemas) is not supported",
                           param="response_format")

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them ({"role", "content": str}): text parts joined,
        `developer` as `system`; tool messages, missing or null content and non-text parts refused."""
        out = []
        for i, m in enumerate(self.messages):
            if m.role in ("tool", "function"):
                raise ApiError(400, "tool and function messages are not supported", param=f"messages.{i}.role")
            content = m.content
            if content is None:
                raise ApiError(400, f"messages.{i}.content: a message needs content (a string or text parts); "
                                    "missing or null content is only for an assistant's tool calls, which are "
                                    "not supported",
                               param=f"messages.{i}.content")
            if isinstance(content, list):
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise ApiError(400, f"only text content is supported, got a {part.type!r} part",
                                       param=f"messages.{i}.content")
                content = "".join(part.text for part in content)
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]  # (token ids: OpenAI's form, refused in words below)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if isinstance(self.prompt, list) and any(not isinstance(p, str) for p in self.prompt):
            raise ApiError(400, "token-id prompts are not supported: send the prompt as text", param="prompt")
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix (insertion) is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of > 1 is not supported", param="best_of")

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ApiError(400, f"one prompt per request, got {len(self.prompt)}", param="prompt")
        return self.prompt[0]


def parse(kind: type[_Generation], body: object, served: str) -> _Generation:
    """A request of `kind` from a decoded JSON body, checked: 400 for wrong types or unsupported
    options, 404 for a model other than the one served."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None
    if request.model is not None and request.model != served:
        raise ApiError(404, f"the model {request.model!r} does not exist: this server serves {served!r}",
                       param="model", code="model_not_found")
    request.refuse_unsupported()
    request.stop_strings()
    return request


def refuse_long_prompt(chars: int, context: int | None, longest_token: int | None, param: str) -> None:
    """Refuse, before tokenising it, a prompt of `chars` characters that cannot fit: no token stands for
    more than `longest_token` characters, so it is at least chars / longest_token tokens, and a prompt of
    `context` tokens leaves no room for an answer (the same 400 as `answer_budget` would give)."""
    if context is None or longest_token is None or chars <= (context - 1) * longest_token:
        return
    raise ApiError(400, f"the prompt is {chars} characters: the model's context is {context} tokens, which hold at "
                        f"most {(context - 1) * longest_token} characters of prompt (a token of this model is at most "
                        f"{longest_token} characters)", code="context_length_exceeded", param=param)


def refuse_long_conversation(body: object, context: int | None) -> None:
    """Refuse, before its messages are read, a conversation of `context` messages or more: a chat template
    marks every message with at least one token (its role), so it cannot fit."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if context is None or not isinstance(messages, list) or len(messages) < context:
        return
    raise ApiError(400, f"the conversation has {len(messages)} messages: the model's context is {context} tokens, "
                        f"at least one a message", code="context_length_exceeded", param="messages")


def answer_budget(requested: int | None, prompt_tokens: int, context: int | None, default: int) -> int:
    """The longest answer: what was asked for (else what is left of the context, else `default`),
    bounded by the model's context: a prompt or a request that does not fit is a 400."""
    if context is None:
        return requested or default
    room = context - prompt_tokens
    if room < 1:
        raise ApiError(400, f"the prompt is {prompt_tokens} tokens: the model's context is {context} tokens",
                       code="context_length_exceeded", param="messages")
    if requested is not None and requested > room:
        raise ApiError(400, f"the model's context is {context} tokens: {prompt_tokens} in the prompt leave at most "
                            f"{room} for the answer, {requested} were requested", code="context_length_exceeded",
                       param="max_tokens")
    return requested or room


# --- stop strings ---------------------------------------------------------------


def first_stop(text: str, stops) -> int | None:
    """Where generation would have stopped in `text`, read a character at a time: at the first point where a
    stop string is complete, the text is cut where the earliest stop string within it begins (with stops
    'a' and 'baa', 'baa' stops after 'ba', at 'a': 'b'). None if no stop string is in `text`."""
    ends = [i + len(s) for s in stops for i in (text.find(s),) if i >= 0]
    if not ends:
        return None
    head = text[:min(ends)]
    return min(i for i in (head.find(s) for s in stops) if i >= 0)


class StopText:
    """The answer's text with stop strings cut off: `add` returns what may be shown now and whether
    a stop string was found. Text that could be the start of a stop string is held back until the
    next piece tells (so a stop string split across tokens never shows); `flush` gives it at the end."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = stops
        self.pending = ""

    def add(self, text: str) -> tuple[str, bool]:
        self.pending += text
        cut = first_stop(self.pending, self.stops)
        if cut is not None:
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# --- responses ------------------------------------------------------------------


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV cache was reused from the previous request

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the engine's reasons (and a stop string's) in OpenAI's words


@dataclass
class Reply:
    """One response's identity; builds its body (`whole`) or its stream chunks (`chunk`)."""

    chat: bool  # /v1/chat/completions, else /v1/completions
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": "fmoe"}

    def whole(self, text: str, finish: str, usage: Usage) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": FINISH[finish]} if self.chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": FINISH[finish]})
        return self._head(False) | {"choices": [choice], "usage": usage.body()}

    def chunk(self, text: str | None = None, finish: str | None = None, *, role: bool = False,
              usage: Usage | None = None, include_usage: bool = False) -> dict:
        """A stream chunk: new text, the role (chat's first chunk), the finish reason (the last
        choice chunk), or — `usage` — the usage chunk after it (no choices)."""
        body = self._head(True)
        if usage is not None:
            return body | {"choices": [], "usage": usage.body()}
        reason = FINISH[finish] if finish is not None else None
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return body | {"choices": [choice]} | ({"usage": None} if include_usage else {})
