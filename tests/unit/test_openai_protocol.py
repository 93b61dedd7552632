"""The OpenAI API's rules (services/router/openai/protocol.py): bodies -> GenerateRequest,
router messages -> OpenAI objects, gRPC statuses -> HTTP errors. Exact, no I/O."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tandem.services.router.openai import answers
from tandem.services.router.openai import protocol as oai
from tandem.v1 import router_pb2 as rpb

MODEL = "m"
DEFAULT_MAX = 100
USER = [{"role": "user", "content": "hi"}]


def chat(**body: Any) -> oai.ParsedRequest:
    return oai.parse_chat({"model": MODEL, "messages": USER, **body}, MODEL, DEFAULT_MAX)


def completion(**body: Any) -> oai.ParsedRequest:
    return oai.parse_completion({"model": MODEL, "prompt": "p", **body}, MODEL, DEFAULT_MAX)


def refusal(parse: Any, **body: Any) -> oai.ApiError:
    with pytest.raises(oai.ApiError) as err:
        parse(**body)
    return err.value


def test_chat_fields_map_to_the_request() -> None:
    parsed = oai.parse_chat(
        {
            "model": MODEL,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
                {"role": "assistant", "content": "c", "name": "bot"},
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99,  # the newer field wins
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": -1,
            "stop": "END",
            "presence_penalty": 0.25,
            "frequency_penalty": -0.5,
            "logprobs": True,
            "top_logprobs": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u-1",
            "top_k": 5,
            "ignore_eos": True,
            "stop_token_ids": [2, 3],
            "add_generation_prompt": False,
        },
        MODEL,
        DEFAULT_MAX,
    )  # fmt: skip
    req = parsed.request
    # developer stays developer on the wire; the template renders it as system (tandem.chat).
    assert [(m.role, m.content, m.name) for m in req.chat.messages] == [
        ("developer", "be brief", ""),
        ("user", "ab", ""),
        ("assistant", "c", "bot"),
    ]
    assert req.chat.add_generation_prompt is False
    assert req.model == MODEL and req.request_id == ""
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed) == (7, 0.5, pytest.approx(0.9), 2**64 - 1)
    assert (list(s.stop), s.presence_penalty, s.frequency_penalty) == (["END"], 0.25, -0.5)
    assert (s.logprobs, s.top_k, s.ignore_eos, list(s.stop_token_ids)) == (3, 5, True, [2, 3])
    assert (parsed.stream, parsed.include_usage, parsed.logprobs, parsed.top_logprobs) == (
        True,
        True,
        True,
        3,
    )
    assert parsed.user == "u-1"


def test_a_tool_history_is_carried_on_the_wire() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    wire = chat(messages=messages).request.chat.messages
    assert [(m.role, m.content, m.tool_call_id) for m in wire] == [
        ("user", "Weather in Paris?", ""),
        ("assistant", "", ""),
        ("tool", "sunny", "call_1"),
    ]
    [sent] = wire[1].tool_calls
    assert (sent.id, sent.function.name, sent.function.arguments) == (
        "call_1", "get_weather", '{"city": "Paris"}',
    )  # fmt: skip


def test_logit_bias_maps_token_ids_to_biases() -> None:
    for parse in (chat, completion):
        bias = parse(logit_bias={"5": -100, "12": 2.5}).request.sampling.logit_bias
        assert dict(bias) == {5: -100.0, 12: 2.5}
    assert not chat().request.sampling.logit_bias


def test_chat_defaults_leave_the_engine_defaults() -> None:
    parsed = oai.parse_chat({"messages": USER}, MODEL, DEFAULT_MAX)
    s = parsed.request.sampling
    assert s.max_tokens == DEFAULT_MAX  # up to the context, as OpenAI does
    for name in ("temperature", "top_p", "seed", "logprobs", "top_k", "ignore_eos"):
        assert not s.HasField(name), name
    assert parsed.request.model == ""  # no model: the router's only one
    assert not parsed.request.chat.HasField("add_generation_prompt")
    assert (parsed.stream, parsed.include_usage, parsed.logprobs) == (False, False, False)
    assert chat(logprobs=True).request.sampling.logprobs == 0  # the sampled token only
    assert not chat(top_k=-1).request.sampling.HasField("top_k")  # vLLM's "off"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": "hi"}, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "integer"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]", "image_url"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
         "messages[0].tool_calls[0].function", "JSON object, got null"),
        ({"messages": [{"role": "tool", "content": "r", "tool_call_id": "c"}]},
         "messages[0].tool_call_id", "answers no tool call"),
        ({"n": 65}, "n", "must be in [1, 64], got 65"),
        ({"n": 0}, "n", "must be in [1, 64], got 0"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "JSON object, got null"),
        ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
        ({"functions": [{"name": "f"}]}, "functions", "legacy function calling"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[5] must be in [-100, 100], got 101"),
        ({"logit_bias": {"5": "1"}}, "logit_bias", "[5] must be a finite number, got string"),
        ({"logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids, got 'a'"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "keys must be token ids, got '-1'"),
        ({"logit_bias": [1]}, "logit_bias", "must map token ids to numbers, got array"),
        ({"modalities": ["audio"]}, "modalities", "text"),
        ({"temperature": "hot"}, "temperature", "finite number, got string"),
        ({"temperature": True}, "temperature", "boolean"),
        ({"temperature": 9}, "temperature", "at most 2, got 9"),
        ({"temperature": 2.01}, "temperature", "at most 2, got 2.01"),
        ({"top_p": float("nan")}, "top_p", "finite number"),
        ({"max_tokens": 0}, "max_tokens", ">= 1, got 0"),
        ({"max_tokens": 1.5}, "max_tokens", "integer, got number"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "[0, 20]"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ({"logprobs": 1}, "logprobs", "boolean"),
        ({"stop": ["a", ""]}, "stop", "non-empty string"),
        ({"stop": 5}, "stop", "non-empty string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "token ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
        ({"stream": True, "stream_options": []}, "stream_options", "JSON object"),
        ({"user": 5}, "user", "string"),
        ({"model": 5}, "model", "string"),
    ],
)  # fmt: skip
def test_chat_refusals_name_the_field(body: dict[str, Any], param: str, says: str) -> None:
    err = refusal(chat, **body)
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")
    assert err.message.startswith(f"{param}: ") and says in err.message
    error = {"message": err.message, "type": "invalid_request_error", "param": param}
    assert err.body() == {"error": {**error, "code": None}}


def test_unknown_model_is_404_model_not_found() -> None:
    err = refusal(chat, model="gpt-4")
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    assert "'gpt-4'" in err.message and "'m'" in err.message


def test_a_body_that_is_no_object_is_refused() -> None:
    with pytest.raises(oai.ApiError) as err:
        oai.parse_chat([1], MODEL, DEFAULT_MAX)
    assert err.value.param == "body"
    assert err.value.message == "body: must be a JSON object, got array"


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("hello", "hello", []),
        (["hello"], "hello", []),
        ([1, 2, 3], "", [1, 2, 3]),
        ([[4, 5]], "", [4, 5]),
    ],
)
def test_completion_prompts(prompt: Any, text: str, ids: list[int]) -> None:
    req = completion(prompt=prompt).request
    assert (req.text, list(req.token_ids.ids)) == (text, ids)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": []}, "prompt", "non-empty list"),
        ({"prompt": ["a", ""]}, "prompt", "[1] must not be empty"),
        ({"prompt": [[1], "x", 3]}, "prompt", "[2] must be a non-empty string or a list of token"),
        ({"prompt": [[1], []]}, "prompt", "[1] must be a non-empty string or a list of token"),
        ({"prompt": [1, -2]}, "prompt", "token ids"),
        ({"prompt": [True]}, "prompt", "token ids"),
        ({"prompt": None}, "prompt", "non-empty string"),
        ({"echo": True, "logprobs": 1}, "echo", "echo with logprobs needs the prompt's logprobs"),
        ({"echo": 1}, "echo", "boolean"),
        ({"prompt": ["a", "b"], "n": 33}, "n", "2 prompts x n 33 is over 64 choices"),
        ({"n": 2, "best_of": 3}, "best_of", "only best_of = n (2) is supported, got 3"),
        ({"suffix": "x"}, "suffix", "not supported"),
        ({"best_of": 2}, "best_of", "only best_of = n (1)"),
        ({"logprobs": 6}, "logprobs", "[0, 5]"),
        ({"logprobs": True}, "logprobs", "integer"),
    ],
)
def test_completion_refusals(body: dict[str, Any], param: str, says: str) -> None:
    err = refusal(completion, **body)
    assert (err.status, err.param) == (400, param) and says in err.message


def test_completion_prompt_lists_n_and_echo() -> None:
    parsed = completion(prompt=["a", [7, 8], "c"], n=3, best_of=3, echo=True, seed=5)
    assert (parsed.n, parsed.echo, parsed.num_choices) == (3, True, 9)
    inputs = [parsed.request, *parsed.more_prompts]
    assert [(r.text, list(r.token_ids.ids)) for r in inputs] == [("a", []), ("", [7, 8]), ("c", [])]
    # Every prompt's request carries the same sampling.
    assert {(r.sampling.seed, r.sampling.max_tokens) for r in inputs} == {(5, DEFAULT_MAX)}
    single = completion()
    assert (single.n, single.echo, single.more_prompts, single.num_choices) == (1, False, (), 1)
    assert chat(n=4).num_choices == 4


def test_completion_logprobs_and_max_tokens() -> None:
    parsed = completion(logprobs=2, max_tokens=9)
    assert (parsed.logprobs, parsed.top_logprobs, parsed.request.sampling.logprobs) == (True, 2, 2)
    assert parsed.request.sampling.max_tokens == 9
    zero = completion(logprobs=0)
    assert (zero.logprobs, zero.request.sampling.logprobs) == (True, 0)
    assert completion().request.sampling.max_tokens == DEFAULT_MAX


@pytest.mark.parametrize(
    ("code", "status", "type_", "error_code"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", None),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error", "invalid_api_key"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error", None),
        (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "not_found"),
        (grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error", "conflict"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", "service_unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout", "timeout"),
        (grpc.StatusCode.FAILED_PRECONDITION, 500, "server_error", None),
        (grpc.StatusCode.INTERNAL, 500, "server_error", None),
    ],
)
def test_statuses_map_to_http(
    code: grpc.StatusCode, status: int, type_: str, error_code: str | None
) -> None:
    err = oai.from_status(code, "why")
    assert (err.status, err.type, err.code, err.message) == (status, type_, error_code, "why")
    assert err.headers() == {}


def test_pushback_becomes_retry_after_headers() -> None:
    err = oai.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_after_ms=1500)
    assert err.headers() == {"retry-after-ms": "1500", "retry-after": "2"}
    assert oai.from_status(grpc.StatusCode.UNAVAILABLE, "x", 1).headers()["retry-after"] == "1"


TEXTS = {1: "He", 2: "llo", 3: "!", 9: "lo"}


def answer(parsed: oai.ParsedRequest, chat_: bool) -> answers.Answer:
    return answers.Answer("id-1", MODEL, chat_, parsed, TEXTS.__getitem__, created=123)


def chunk(ids: list[int], text: str, with_logprobs: bool = False) -> rpb.Chunk:
    msg = rpb.Chunk(token_ids=ids, text=text)
    if with_logprobs:
        for i in ids:
            top = [rpb.TopLogprob(token_id=9, logprob=-1.0)]
            msg.logprobs.add(token_id=i, logprob=-0.5, top=top)
    return msg


COMPLETE = rpb.Complete(
    finish_reason=rpb.FINISH_REASON_LENGTH,
    usage=rpb.Usage(prompt_tokens=4, completion_tokens=3, cached_prompt_tokens=2),
)
USAGE = {
    "prompt_tokens": 4,
    "completion_tokens": 3,
    "total_tokens": 7,
    "prompt_tokens_details": {"cached_tokens": 2},
}


def test_chat_stream_objects() -> None:
    a = answer(chat(stream=True, stream_options={"include_usage": True}), chat_=True)
    head = {"id": "id-1", "object": "chat.completion.chunk", "created": 123, "model": MODEL}
    assert a.first() == {
        **head,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}],
        "usage": None,
    }  # fmt: skip
    assert a.chunk(chunk([1, 2], "Hello")) == {
        **head,
        "choices": [{"index": 0, "delta": {"content": "Hello"}, "logprobs": None,
                     "finish_reason": None}],
        "usage": None,
    }  # fmt: skip
    assert a.last(COMPLETE)["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert a.usage_chunk(COMPLETE) == {**head, "choices": [], "usage": USAGE}


def test_chat_whole_answer_with_logprobs() -> None:
    a = answer(chat(logprobs=True, top_logprobs=1), chat_=True)
    a.chunk(chunk([1], "He", with_logprobs=True))
    a.chunk(chunk([2, 3], "llo!", with_logprobs=True))
    whole = a.whole(COMPLETE)
    assert whole["object"] == "chat.completion" and "usage" in whole
    assert whole["usage"] == USAGE
    choice = whole["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello!"}
    assert choice["finish_reason"] == "length"
    alt = {"token": "lo", "logprob": -1.0, "bytes": [108, 111]}
    assert choice["logprobs"] == {
        "content": [
            {"token": "He", "logprob": -0.5, "bytes": [72, 101], "top_logprobs": [alt]},
            {"token": "llo", "logprob": -0.5, "bytes": [108, 108, 111], "top_logprobs": [alt]},
            {"token": "!", "logprob": -0.5, "bytes": [33], "top_logprobs": [alt]},
        ]
    }


def test_completion_logprobs_offsets_run_across_chunks() -> None:
    a = answer(completion(logprobs=1, stream=True), chat_=False)
    first = a.chunk(chunk([1], "He", with_logprobs=True))
    second = a.chunk(chunk([2, 3], "llo!", with_logprobs=True))
    assert first["object"] == "text_completion" and "usage" not in first
    assert first["choices"][0]["text"] == "He"
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second["choices"][0]["logprobs"] == {
        "tokens": ["llo", "!"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"lo": -1.0}, {"lo": -1.0}],
        "text_offset": [2, 5],
    }
    assert a.last(COMPLETE)["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    ]
    whole = a.whole(COMPLETE)["choices"][0]
    assert whole["text"] == "Hello!"
    assert whole["logprobs"]["text_offset"] == [0, 2, 5]


def test_finish_reasons() -> None:
    assert answers.finish_reason(rpb.FINISH_REASON_STOP) == "stop"
    assert answers.finish_reason(rpb.FINISH_REASON_LENGTH) == "length"
    assert answers.finish_reason(rpb.FINISH_REASON_ABORT) == "abort"


def test_models_list() -> None:
    assert answers.models("m", 2048, 5) == {
        "object": "list",
        "data": [
            {
                "id": "m",
                "object": "model",
                "created": 5,
                "owned_by": "tandem",
                "max_model_len": 2048,
            }
        ],  # fmt: skip
    }
