"""The OpenAI HTTP API's rules, as pure code: request bodies -> GenerateRequest, ServiceError
-> OpenAI error objects (the answers: tandem.services.router.openai.answers).

No I/O here (tandem.services.router.openai.http serves it). Every refusal is an `ApiError` naming
the
field, so a client sees a 400 it can act on rather than a 422 listing validator internals.
Extensions beyond OpenAI's fields (vLLM's names): top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, guided_json, guided_regex, guided_choice, guided_grammar
(tandem.services.router.openai.structured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import grpc

from tandem import chat
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.convert_tools import ChatTools
from tandem.services.router.inputs import NO_TOOLS
from tandem.services.router.openai import choices as choices
from tandem.services.router.openai import structured as structured
from tandem.services.router.openai import tools as tools
from tandem.tools import ToolError, ToolFormat
from tandem.v1 import router_pb2 as rpb

JSON = dict[str, Any]
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs limit in OpenAI's API
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs limit
# Sampling fields that are numbers on both sides, under the same names.
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)  # fmt: skip
# OpenAI's documented upper bound, refused rather than served as given (the engine's
# SamplingParams refuses negative values itself).
_FLOAT_MAX = {"temperature": 2.0}
# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code).
_HTTP_ERRORS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error", "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "timeout"),
}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_ms: int = 0,
    ) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_ms = retry_after_ms

    def body(self) -> JSON:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**error, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Pushback the openai client honours (retry-after-ms first, then retry-after)."""
        if not self.retry_after_ms:
            return {}
        seconds = max(1, math.ceil(self.retry_after_ms / 1e3))
        return {"retry-after-ms": str(self.retry_after_ms), "retry-after": str(seconds)}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def from_status(code: grpc.StatusCode, message: str, retry_after_ms: int = 0) -> ApiError:
    """The HTTP face of a gRPC status the router raised (anything unlisted: 500)."""
    status, type_, error_code = _HTTP_ERRORS.get(code, (500, "server_error", None))
    return ApiError(status, message, type_, None, error_code, retry_after_ms)


# -- requests --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A request body as the router takes it, and how to answer it.

    logprobs: per-token logprobs wanted; top_logprobs: how many alternatives per token.
    n: sequences per prompt; more_prompts: completions' 2nd, 3rd, ... prompts (`request` is
    the first's); echo: completions' prompt text before each choice's text
    (tandem.services.router.openai.choices plans the choices).
    """

    request: rpb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    user: str = ""
    n: int = 1
    more_prompts: tuple[rpb.GenerateRequest, ...] = ()
    echo: bool = False
    # Chat with tools (tandem.services.router.openai.tools): the functions an answer may call (none:
    # text only) and how the model writes calls (the router's tool-call parser).
    tool_names: frozenset[str] = frozenset()
    tool_format: ToolFormat | None = None
    # What the core's input is read from (tandem.services.router.inputs.http_input), each read from
    # the body once: a chat's messages (checked) and tools (shapes checked; http.py compiles
    # their schemas), and the body's constraint with the field that asked for it (http.py
    # compiles it; `request` carries a copy for the choices' plans only).
    messages: tuple[chat.Message, ...] = ()
    tools: ChatTools = NO_TOOLS
    constraint: tuple[rpb.Constraint, str] | None = None

    @property
    def num_choices(self) -> int:
        return self.n * (1 + len(self.more_prompts))


def parse_chat(body: Any, model_id: str, default_max_tokens: int) -> ParsedRequest:
    """POST /v1/chat/completions. Raises ApiError."""
    body = _object(body)
    _refuse_unsupported(body, tools_ok=True)
    request = rpb.GenerateRequest(model=_model(body, model_id))
    try:  # the gRPC Chat input's rule too
        messages = chat.messages_from_json(body.get("messages"))
    except chat.ChatError as error:
        raise invalid(error.field, error.reason) from None
    request.chat.messages.extend(convert.chat_message_to_proto(m) for m in messages)
    if "add_generation_prompt" in body:
        request.chat.add_generation_prompt = _bool(body, "add_generation_prompt", True)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1)
    found = _sampling(request.sampling, body, max_tokens or default_max_tokens)
    if logprobs:
        request.sampling.logprobs = top
    try:  # tools; http.py compiles their schemas off the event loop
        body_tools = tools.read(body, request.chat, found[1] if found else None)
    except ToolError as error:
        raise invalid(error.field, error.reason) from None
    return replace(
        _parsed(body, request, logprobs, top),
        tool_names=body_tools.names,
        messages=messages,
        tools=ChatTools(body_tools.tools, body_tools.choice, body_tools.parallel),
        constraint=found,
    )


def parse_completion(body: Any, model_id: str, default_max_tokens: int) -> ParsedRequest:
    """POST /v1/completions (the legacy text API). Raises ApiError."""
    body = _object(body)
    _refuse_unsupported(body)
    if body.get("suffix") not in (None, ""):
        raise invalid("suffix", "suffix (insertion) is not supported")
    n = _int(body, "n", 1, 1)
    best_of = _int(body, "best_of", n, 1)
    if best_of != n:
        raise invalid("best_of", f"only best_of = n ({n}) is supported, got {best_of}")
    request = rpb.GenerateRequest(model=_model(body, model_id))
    try:
        prompts = choices.parse_prompts(body.get("prompt"))
    except ValueError as exc:
        raise invalid("prompt", str(exc)) from None
    top = _int(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    echo = _bool(body, "echo", False)
    if echo and top is not None:
        raise invalid(
            "echo",
            "echo with logprobs needs the prompt's logprobs, which Tandem does not compute; "
            "ask for echo or for logprobs",
        )
    max_tokens = _int(body, "max_tokens", None, 1) or default_max_tokens
    found = _sampling(request.sampling, body, max_tokens)
    if top is not None:
        request.sampling.logprobs = top
    requests = []
    for prompt in prompts:
        one = rpb.GenerateRequest()
        one.CopyFrom(request)
        if isinstance(prompt, str):
            one.text = prompt
        else:
            one.token_ids.ids.extend(prompt)
        requests.append(one)
    parsed = _parsed(body, requests[0], top is not None, top or 0)
    return replace(parsed, more_prompts=tuple(requests[1:]), echo=echo, constraint=found)


def _parsed(body: JSON, request: rpb.GenerateRequest, logprobs: bool, top: int) -> ParsedRequest:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "only allowed when stream is true")
        include_usage = _bool(_object(options, "stream_options"), "include_usage", False)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"must be a string, got {_kind(user)}")
    n = _int(body, "n", 1, 1, choices.MAX_CHOICES)
    prompt = body.get("prompt")
    num_prompts = len(prompt) if isinstance(prompt, list) and _is_prompt_list(prompt) else 1
    if n * num_prompts > choices.MAX_CHOICES:
        raise invalid("n", f"{num_prompts} prompts x n {n} is over {choices.MAX_CHOICES} choices")
    return ParsedRequest(request, stream, include_usage, logprobs, top, user or "", n)


def _is_prompt_list(prompt: list[Any]) -> bool:
    """A list of prompts (strings or id lists), not one prompt of token ids."""
    return all(isinstance(p, str | list) for p in prompt)


def _refuse_unsupported(body: JSON, tools_ok: bool = False) -> None:
    """Fields that would change the answer and that Tandem cannot honour: refused, never
    silently ignored. `tools_ok`: chat reads tools itself (tools.py)."""
    for name in ("tools", "functions"):
        if body.get(name) and not tools_ok:
            raise invalid(name, "tool and function calling are not supported")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none") and not tools_ok:
            raise invalid(name, "tool and function calling are not supported")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid("modalities", 'only ["text"] is supported')


def _sampling(
    msg: rpb.SamplingParams, body: JSON, max_tokens: int
) -> tuple[rpb.Constraint, str] | None:
    """The body's sampling fields into `msg`; returns its constraint and the field that
    asked for it (the one read of them: http.py compiles it off the event loop)."""
    msg.max_tokens = max_tokens
    try:  # structured output
        constraint = structured.read(body)
    except structured.FieldError as error:
        raise invalid(error.param, error.reason) from None
    if constraint is not None:
        msg.constraint.CopyFrom(constraint[0])
    for name in _FLOAT_FIELDS:
        value = _float(body, name)
        if value is not None:
            setattr(msg, name, value)
    seed = _int(body, "seed", None)
    if seed is not None:
        msg.seed = seed % 2**64  # OpenAI takes any int64; the engine a uint64
    top_k = _int(body, "top_k", None)
    if top_k is not None and top_k > 0:  # vLLM's "-1 = off" is also off here
        msg.top_k = top_k
    if "ignore_eos" in body:
        msg.ignore_eos = _bool(body, "ignore_eos", False)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise invalid("stop", "must be a non-empty string or a list of them")
        msg.stop.extend(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise invalid("stop_token_ids", "must be a list of token ids")
        msg.stop_token_ids.extend(ids)
    for token_id, bias in _logit_bias(body.get("logit_bias")).items():
        msg.logit_bias[token_id] = bias
    return constraint


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias}; the ids' range is the router's check (the vocabulary)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"must map token ids to numbers, got {_kind(value)}")
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= 2**32:
            raise invalid("logit_bias", f"keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise invalid("logit_bias", f"[{key}] must be a finite number, got {_kind(bias)}")
        if not -100 <= bias <= 100:
            raise invalid("logit_bias", f"[{key}] must be in [-100, 100], got {bias!r}")
        out[int(key)] = float(bias)
    return out


def _model(body: JSON, model_id: str) -> str:
    model = body.get("model")
    if model in (None, ""):
        return ""  # the router's only model
    if not isinstance(model, str):
        raise invalid("model", f"must be a string, got {_kind(model)}")
    if model != model_id:
        raise ApiError(
            404,
            f"The model {model!r} does not exist; this server serves {model_id!r}",
            param="model",
            code="model_not_found",
        )
    return model


def _object(value: Any, where: str = "body") -> JSON:
    if not isinstance(value, dict):
        raise invalid(where, f"must be a JSON object, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return "null" if value is None else names.get(type(value), "object")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bool(body: JSON, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"must be a boolean, got {_kind(value)}")
    return value


def _int(body: JSON, name: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(name, f"must be an integer, got {_kind(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(name, f"must be {bounds}, got {value}")
    return value


def _float(body: JSON, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(name, f"must be a finite number, got {_kind(value)}")
    if value > _FLOAT_MAX.get(name, math.inf):
        raise invalid(name, f"must be at most {_FLOAT_MAX[name]:g}, got {value!r}")
    return float(value)
