"""One front door (issue 39): each API reads a request's sampling parameters, constraint,
tools and messages once, and hands the router's core a typed input it never re-reads.

Counted on the real HTTP app (FastAPI, in process) in front of a stand-in router that reads
its input as the real one does (`Source.read`), and on the gRPC reader (`Prompts.read`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tandem import chat
from tandem.engine.grammar import ConstraintKind
from tandem.services.common.rpc import convert
from tandem.services.router import prompts as prompts_module
from tandem.services.router.inputs import ChatPrompt, GenerateInput, Source
from tandem.services.router.openai import structured
from tandem.services.router.openai import tools as openai_tools
from tandem.services.router.openai.http import OpenAIServer
from tandem.services.router.prompts import Prompts
from tandem.tools import DEFAULT_FORMAT, get_format
from tandem.v1 import router_pb2 as rpb

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


class Counted:
    """Wraps a module's function and counts its calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.calls = 0
        original: Callable[..., Any] = getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


class StandIn:
    """What the HTTP API needs of the router: it reads each call's input as
    RouterServer.generate does, once, and answers with one completion."""

    model_id = "m"
    max_model_len = 64
    tool_format = get_format(DEFAULT_FORMAT)

    def __init__(self) -> None:
        self.inputs: list[GenerateInput] = []

    async def generate(
        self, source: Source, context: Any, tenant: str
    ) -> AsyncGenerator[rpb.GenerateResponse, None]:
        self.inputs.append(await source.read())
        complete = rpb.Complete(
            finish_reason=rpb.FINISH_REASON_STOP, usage=rpb.Usage(prompt_tokens=3)
        )
        yield rpb.GenerateResponse(complete=complete)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, Counted]:
    return {
        "response_format read": Counted(monkeypatch, structured, "read"),
        "constraint compiled": Counted(monkeypatch, convert, "constraint_from_proto"),
        "tools read": Counted(monkeypatch, openai_tools, "tools_from_json"),
        "tool schemas compiled": Counted(monkeypatch, openai_tools, "check"),
        "chat rule": Counted(monkeypatch, chat, "check_messages"),
    }


def test_an_http_chat_reads_its_response_format_tools_and_messages_once(
    counts: dict[str, Counted],
) -> None:
    router = StandIn()
    server = OpenAIServer(router, None)  # type: ignore[arg-type]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Give me a."}],
        "max_tokens": 5,
        "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        "tools": [TOOL],
        "tool_choice": "none",
    }
    with TestClient(server.app) as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert {name: c.calls for name, c in counts.items()} == {
        "response_format read": 1,
        "constraint compiled": 1,
        "tools read": 1,
        "tool schemas compiled": 1,
        "chat rule": 1,
    }
    [inp] = router.inputs
    assert isinstance(inp.prompt, ChatPrompt)
    assert inp.prompt.messages == (chat.Message("user", "Give me a."),)
    assert [t.name for t in inp.prompt.tools.tools] == ["f"]
    assert inp.params.constraint is not None
    assert inp.params.constraint.kind is ConstraintKind.JSON_SCHEMA
    assert (inp.params.max_tokens, inp.params.seed) == (5, 7)


def test_choices_share_the_one_parse_and_differ_in_seed_and_label(
    counts: dict[str, Counted],
) -> None:
    router = StandIn()
    server = OpenAIServer(router, None)  # type: ignore[arg-type]
    body = {"model": "m", "prompt": "a", "n": 3, "seed": 11, "guided_regex": "[0-9]+"}
    with TestClient(server.app) as client:
        reply = client.post("/v1/completions", json=body, headers={"x-request-id": "r"})
    assert reply.status_code == 200, reply.text
    assert counts["response_format read"].calls == 1
    assert counts["constraint compiled"].calls == 1  # not once per choice
    assert [i.label for i in router.inputs] == ["r", "r#1", "r#2"]
    seeds = [i.params.seed for i in router.inputs]
    assert seeds[0] == 11 and len(set(seeds)) == 3
    assert all(i.prompt == "a" and i.params.constraint is not None for i in router.inputs)
    assert len({id(i.params.constraint) for i in router.inputs}) == 1  # the same compiled one


def test_a_grpc_request_is_read_once_into_the_same_input(
    counts: dict[str, Counted], tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chat_rule = Counted(monkeypatch, prompts_module, "check_messages")  # as prompts.py names it
    prompts = Prompts(str(tiny_model_dir), "tiny")
    try:
        request = rpb.GenerateRequest(
            request_id="g1",
            chat=rpb.ChatMessages(
                messages=[rpb.ChatMessage(role="user", content="hi")],
                tools=[rpb.Tool(function=rpb.FunctionDefinition(name="f"))],
            ),
            sampling=rpb.SamplingParams(max_tokens=4, constraint=rpb.Constraint(regex="[a-z]+")),
        )
        inp = asyncio.run(prompts.read(request))
        spec = asyncio.run(prompts.spec(inp, "server-id", None))
    finally:
        prompts.close()
    assert counts["constraint compiled"].calls == 1 and chat_rule.calls == 1
    assert inp.label == "g1" and isinstance(inp.prompt, ChatPrompt)
    assert [t.name for t in inp.prompt.tools.tools] == ["f"]
    assert spec.params.constraint is inp.params.constraint  # the core did not re-read it
    assert spec.request_id == "server-id" and spec.num_prompt_tokens > 0
