"""Tool calling end to end on `tandem up` (router, prefill and decode worker processes) with the
real `openai` client and gRPC: required and named tool choices always return calls whose
arguments validate against the tool's schema (forced by the grammar, so even the tiny random
model does), streamed deltas come as OpenAI sends them and reassemble to the whole answer's
calls, parallel forced calls stop at their bound and, cut by max_tokens, keep the calls
written whole (streamed and not), a forced call holds after the hand-off, the tools reach
the prompt (a preamble for the tiny model's template, which has no tools) and leave it with
tool_choice none, a tool result in the history is answered, and bad tools are refused before
any work."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from tandem.client import TandemClient
from tandem.services.up import Cluster
from tandem.tools import FORMATS, MAX_FORCED_CALLS
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc
from tandem.weights.tiny import EOS_ID, EOT_ID

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def grpc_client(cluster: Cluster) -> Iterator[TandemClient]:
    with TandemClient(cluster.router_address, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster: Cluster) -> Iterator[rgrpc.RouterStub]:
    with grpc.insecure_channel(cluster.router_address) as channel:
        yield rgrpc.RouterStub(channel)


def ask(prompt: str = "") -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt or f"Weather in Oslo? ({uuid.uuid4().hex[:6]})"}]


def long_prompt() -> str:
    """Over the router's 64 uncached tokens and new each time: disaggregated (short enough
    for the tiny model's 512-token context after the tools' preamble)."""
    tag = uuid.uuid4().hex
    return f"{tag} " + " ".join(f"city {i} of {tag[:8]}," for i in range(8))


def check_calls(calls: list[Any], names: set[str]) -> None:
    """Every call: an id, type function, a tool's name, arguments that validate."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and len(call.id) > 10
        assert call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def stream_calls(
    client: openai.OpenAI, **kwargs: Any
) -> tuple[list[dict[str, Any]], str, str, list[Any]]:
    """Stream a chat and accumulate its tool-call deltas as OpenAI's clients do: (calls as
    {id, name, arguments}, content, finish_reason, every tool-call delta)."""
    calls: dict[int, dict[str, Any]] = {}
    content, reason, deltas = "", "", []
    for chunk in client.chat.completions.create(model="", stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                deltas.append(delta)
                if delta.index not in calls:
                    calls[delta.index] = {"id": delta.id, "name": "", "arguments": ""}
                if delta.function and delta.function.name:
                    calls[delta.index]["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    calls[delta.index]["arguments"] += delta.function.arguments
    return [calls[i] for i in sorted(calls)], content, reason, deltas


def test_required_returns_calls_that_validate(client: openai.OpenAI) -> None:
    for seed, parallel in ((0, False), (1, True), (2, True)):
        out = client.chat.completions.create(
            model="", messages=ask(), tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
            parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        check_calls(calls, {"get_weather", "get_time"})
        if not parallel:
            assert len(calls) == 1


def test_named_choice_streams_deltas_as_openai_and_matches_the_whole_answer(
    client: openai.OpenAI,
) -> None:
    messages = ask()
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs: dict[str, Any] = dict(
        messages=messages, tools=TOOLS, tool_choice=named, temperature=0.0, max_tokens=200
    )
    whole = client.chat.completions.create(model="", **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [c.function.name for c in whole.message.tool_calls or []] == ["get_weather"]
    check_calls(whole.message.tool_calls or [], {"get_weather"})

    calls, content, reason, deltas = stream_calls(client, **kwargs)
    assert reason == "tool_calls" and content == ""
    # OpenAI's shape: the first delta of a call names it (index, id, type, name, arguments
    # ""), the next carries the arguments only: all of them, sent once the call is whole (a
    # call that max_tokens may yet cut is never sent in part).
    first, arguments = deltas
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0, "function", "get_weather", "",
    )  # fmt: skip
    assert first.id.startswith("call_")
    assert arguments.index == 0 and arguments.id is None and arguments.function.name is None
    # Greedy: the streamed call is the whole answer's, to the character.
    want = whole.message.tool_calls[0]  # type: ignore[index]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (want.function.name, want.function.arguments)
    ]


def test_streamed_required_calls_with_several_calls_reassemble(client: openai.OpenAI) -> None:
    for seed in range(3):
        kwargs: dict[str, Any] = dict(
            messages=ask(f"plan a trip {seed}"), tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=seed, max_tokens=300,
        )  # fmt: skip
        calls, content, reason, _ = stream_calls(client, **kwargs)
        whole = client.chat.completions.create(model="", **kwargs).choices[0]
        assert reason == whole.finish_reason == "tool_calls" and content == ""
        got = [(c["name"], c["arguments"]) for c in calls]
        assert got == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
        ]
        for name, arguments in got:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_calls_stop_at_the_bound_and_a_cut_keeps_the_whole_calls(
    client: openai.OpenAI,
) -> None:
    """Parallel calls (OpenAI's default) with EOS banned, so the model would call forever: the
    grammar ends the answer at MAX_FORCED_CALLS calls. Cut by max_tokens before that, the
    answer is the calls written whole (each validates; the one being written is dropped)
    with finish_reason length, the same streamed and whole, a prefix of the uncut calls."""
    kwargs: dict[str, Any] = dict(
        messages=ask("plan a long trip"), tools=TOOLS, tool_choice="required",
        temperature=1.0, seed=5, logit_bias={str(EOS_ID): -100, str(EOT_ID): -100},
    )  # fmt: skip
    full = client.chat.completions.create(model="", max_tokens=1500, **kwargs)
    assert full.choices[0].finish_reason == "tool_calls" and full.usage is not None
    check_calls(full.choices[0].message.tool_calls or [], set(SCHEMAS))
    want = [
        (c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls or []
    ]
    assert len(want) == MAX_FORCED_CALLS
    num_kept = []
    for max_tokens in (full.usage.completion_tokens // 3, 2 * full.usage.completion_tokens // 3):
        whole = client.chat.completions.create(model="", max_tokens=max_tokens, **kwargs)
        choice = whole.choices[0]
        got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert choice.finish_reason == "length" and choice.message.content is None
        assert 1 <= len(got) < len(want) and got == want[: len(got)]
        calls, content, reason, _ = stream_calls(client, max_tokens=max_tokens, **kwargs)
        assert (content, reason) == ("", "length")
        assert [(c["name"], c["arguments"]) for c in calls] == got
        num_kept.append(len(got))
    assert num_kept[0] < num_kept[1]


def test_a_forced_call_holds_after_the_hand_off(grpc_client: TandemClient) -> None:
    """gRPC (typed tools through TandemClient); a long new prompt: the prefill worker samples
    token 1 under the grammar and the decode worker continues it; Complete.tool_calls has
    the calls the text holds."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed, choice in ((5, "required"), (6, named)):
        got = grpc_client.generate(
            messages=[{"role": "user", "content": long_prompt()}], tools=TOOLS,
            tool_choice=choice, max_tokens=200, temperature=1.0, seed=seed,
        )  # fmt: skip
        assert got.disaggregated, got.route_reason
        assert got.finish_reason == "stop", got.text
        parsed = FORMATS["hermes"].parse(got.text, {"get_weather", "get_time"})
        assert parsed.calls and parsed.content == "", got.text
        assert [(c["name"], c["arguments"]) for c in got.tool_calls] == [
            (c.name, c.arguments) for c in parsed.calls
        ]
        assert all(c["id"].startswith("call_") for c in got.tool_calls)
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if isinstance(choice, dict):
            assert [c.name for c in parsed.calls] == ["get_time"]


def test_grpc_answers_without_tools_carry_no_calls(grpc_client: TandemClient) -> None:
    none = grpc_client.generate(
        messages=ask(), tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0.0
    )
    assert none.tool_calls == [] and none.completion_tokens > 0


def test_the_prompt_carries_the_tools_unless_none(stub: rgrpc.RouterStub) -> None:
    """The tiny model's template has no tools: the Hermes preamble opens the prompt."""
    tools = [
        rpb.Tool(function=rpb.FunctionDefinition(name="get_time", parameters=json.dumps(TIME)))
    ]
    user = rpb.ChatMessage(role="user", content="time?")
    with_tools = stub.Tokenize(
        rpb.TokenizeRequest(chat=rpb.ChatMessages(messages=[user], tools=tools)), timeout=30
    )
    assert with_tools.prompt.startswith("<|begin_of_text|><|start_header_id|>system")
    assert '<tools>\n{"type": "function", "function": {"name": "get_time"' in with_tools.prompt
    assert "<tool_call>" in with_tools.prompt
    none = rpb.ToolChoice(mode=rpb.TOOL_CHOICE_MODE_NONE)
    chat = rpb.ChatMessages(messages=[user], tools=tools, tool_choice=none)
    without = stub.Tokenize(rpb.TokenizeRequest(chat=chat), timeout=30)
    plain = stub.Tokenize(rpb.TokenizeRequest(chat=rpb.ChatMessages(messages=[user])), timeout=30)
    assert list(without.token_ids) == list(plain.token_ids)
    # The template drops an assistant's tool_calls: they are in its content, in the format.
    call = rpb.ToolCall(
        id="call_9", function=rpb.FunctionCall(name="get_time", arguments='{"zone": "UTC"}')
    )
    history = [
        user,
        rpb.ChatMessage(role="assistant", tool_calls=[call]),
        rpb.ChatMessage(role="tool", tool_call_id="call_9", content="12:00"),
    ]
    chat = rpb.ChatMessages(messages=history, tools=tools)
    rendered = stub.Tokenize(rpb.TokenizeRequest(chat=chat), timeout=30).prompt
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n<tool_call>\n{"name": "get_time", '
        '"arguments": {"zone": "UTC"}}\n</tool_call><|eot_id|>'
        "<|start_header_id|>tool<|end_header_id|>\n\n12:00<|eot_id|>"
    ) in rendered


def test_a_tool_result_round_trip(client: openai.OpenAI) -> None:
    """Turn 1 forces a call; its result goes back as a tool message; turn 2 answers."""
    messages = ask()
    first = client.chat.completions.create(
        model="", messages=messages, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False, temperature=0.0, max_tokens=200,
    ).choices[0].message  # fmt: skip
    call = (first.tool_calls or [])[0]
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model="", messages=history, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
        temperature=0.0, max_tokens=8,
    )  # fmt: skip
    choice = second.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert second.usage is not None and second.usage.completion_tokens > 0
    # auto: text or calls, whichever the model writes; either is a valid answer.
    auto = client.chat.completions.create(
        model="", messages=history, tools=TOOLS, max_tokens=8, temperature=0.0,  # type: ignore[arg-type]
    ).choices[0]  # fmt: skip
    if auto.finish_reason == "tool_calls":
        check_calls(auto.message.tool_calls or [], {"get_weather", "get_time"})
    else:
        assert auto.message.tool_calls is None and auto.message.content


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'nope' is not a tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}}]},
     "tools[0].function.parameters", ""),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "already the name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format cannot too"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "says"), BAD)
def test_bad_tools_are_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=ask(), max_tokens=4, **body)
    error = err.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert says in error["message"]


def test_bad_tools_are_invalid_argument_on_grpc(stub: rgrpc.RouterStub) -> None:
    bad = rpb.Tool(function=rpb.FunctionDefinition(name="f", parameters='{"type": "string"}'))
    chat = rpb.ChatMessages(messages=[rpb.ChatMessage(role="user", content="hi")], tools=[bad])
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(rpb.GenerateRequest(chat=chat), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.tools[0].function.parameters" in (err.value.details() or "")
    chat = rpb.ChatMessages(
        messages=[rpb.ChatMessage(role="user", content="hi")],
        tools=[rpb.Tool(function=rpb.FunctionDefinition(name="f"))],
        tool_choice=rpb.ToolChoice(function="g"),
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(rpb.GenerateRequest(chat=chat), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.tool_choice.function.name: 'g' is not a tool" in (err.value.details() or "")


# -- the Responses API ---------------------------------------------------------------------------

FLAT_TOOLS: list[Any] = [
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
    for t in TOOLS
]


def test_responses_return_function_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="", input=f"Weather in Oslo? ({uuid.uuid4().hex[:6]})", tools=FLAT_TOOLS,
        tool_choice="required", temperature=0.0, max_output_tokens=200,
    )  # fmt: skip
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed" and whole.output
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    for item in whole.output:
        assert item.type == "function_call" and item.call_id.startswith("call_")
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])

    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" not in kinds
    added = [e for e in events if e.type == "response.output_item.added"]
    fragments: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            fragments[e.item_id] = fragments.get(e.item_id, "") + e.delta
    done = {
        e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"
    }
    assert fragments == done and len(done) == len(added)
    final = events[-1].response  # type: ignore[union-attr]
    assert [(i.name, i.arguments) for i in final.output] == [  # type: ignore[union-attr]
        (i.name, i.arguments)
        for i in whole.output  # type: ignore[union-attr]
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_take_a_function_call_round_trip(client: openai.OpenAI) -> None:
    out = client.responses.create(
        model="", tools=FLAT_TOOLS, max_output_tokens=6, temperature=0.0,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Oslo", "unit": "celsius"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        ],
    )  # fmt: skip
    assert out.status in ("completed", "incomplete") and out.output
    assert out.output[0].type in ("message", "function_call")
