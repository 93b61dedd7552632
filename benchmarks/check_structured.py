"""Structured outputs on the default model (issue 27's acceptance check), end to end:

    python benchmarks/check_structured.py [--model DIR] [--max-tokens N]

Starts `tandem up` (SmolLM2-135M-Instruct by default: 1 prefill + 1 decode worker) and, with
the real `openai` client, asks for 20 varied JSON schemas (nested objects, arrays with
bounds, enums, bounded numbers, required fields, booleans, nullable fields), each
colocated (a short prompt: the decode worker computes it) and disaggregated (a prompt over
the router's 64 uncached tokens: prefilled on the prefill worker, token 1 sampled there
under the grammar, the rest on the decode worker), streamed and not: 80 answers, each
parsed with json.loads and validated with `jsonschema`. Then regex and choice constraints
through `guided_regex` / `guided_choice`, both placements. Then tools: `tool_choice`
required and a named function (`parallel_tool_calls` at OpenAI's default, on, and off; both
placements; streamed deltas reassembled and compared with the whole answer, and the finish
reason), `auto` (text or calls), a second turn with the tool's result; and the Responses
API (`responses.create`): the README's question, a forced tool call and a JSON-schema
answer, streamed and not. Prints one line per answer and a summary; writes
benchmarks/results/structured_default_model.json. Exit 1 when any answer fails.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import REPO_ROOT, RESULTS_DIR, machine_info, write_json

S = {"type": "string", "maxLength": 24}
I = {"type": "integer", "minimum": 0, "maximum": 1000}  # noqa: E741

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {"name": S, "age": I},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("a city", {"type": "object", "properties": {"city": S, "country": S, "population": I},
                "required": ["city", "country"], "additionalProperties": False}),
    ("a colour choice", {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
        "additionalProperties": False}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60}, "station": S},
        "required": ["celsius", "station"], "additionalProperties": False}),
    ("a shopping list", {"type": "object", "properties": {
        "items": {"type": "array", "items": S, "minItems": 1, "maxItems": 4}},
        "required": ["items"], "additionalProperties": False}),
    ("a yes/no answer", {"type": "object", "properties": {"answer": {"type": "boolean"},
                         "reason": S}, "required": ["answer"], "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {"title": S, "author": {
        "type": "object", "properties": {"first": S, "last": S}, "required": ["first", "last"],
        "additionalProperties": False}, "year": {"type": "integer", "minimum": 1450,
        "maximum": 2026}}, "required": ["title", "author", "year"],
        "additionalProperties": False}),
    ("a rating", {"type": "object", "properties": {
        "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": S},
        "required": ["stars"], "additionalProperties": False}),
    ("an order", {"type": "object", "properties": {"id": I, "lines": {
        "type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["id", "lines"], "additionalProperties": False}),
    ("a weekday", {"type": "object", "properties": {"day": {"enum": [
        "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]}},
        "required": ["day"], "additionalProperties": False}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100,
                 "maximum": 100}, "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("a list of numbers", {"type": "array", "items": {"type": "integer", "minimum": 0,
                           "maximum": 99}, "minItems": 2, "maxItems": 5}),
    ("a contact", {"type": "object", "properties": {"email": S, "phone": {
        "anyOf": [S, {"type": "null"}]}}, "required": ["email", "phone"],
        "additionalProperties": False}),
    ("a task", {"type": "object", "properties": {"title": S, "done": {"type": "boolean"},
                "priority": {"enum": ["low", "medium", "high"]}},
                "required": ["title", "done", "priority"], "additionalProperties": False}),
    ("a recipe", {"type": "object", "properties": {"name": S, "steps": {
        "type": "array", "items": S, "minItems": 1, "maxItems": 3},
        "minutes": {"type": "integer", "minimum": 1, "maximum": 240}},
        "required": ["name", "steps", "minutes"], "additionalProperties": False}),
    ("a flight", {"type": "object", "properties": {"from": S, "to": S, "stops": {
        "type": "integer", "minimum": 0, "maximum": 3}}, "required": ["from", "to", "stops"],
        "additionalProperties": False}),
    ("a planet", {"type": "object", "properties": {"name": S, "moons": I, "rocky": {
        "type": "boolean"}}, "required": ["name", "moons", "rocky"],
        "additionalProperties": False}),
    ("a tag set", {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "enum": ["news", "sport", "tech", "art"]}, "maxItems": 3}}, "required": ["tags"],
        "additionalProperties": False}),
    ("a score board", {"type": "object", "properties": {"home": I, "away": I, "final": {
        "type": "boolean"}}, "required": ["home", "away", "final"],
        "additionalProperties": False}),
    ("a nested config", {"type": "object", "properties": {"server": {
        "type": "object", "properties": {"host": S, "port": {"type": "integer", "minimum": 1,
        "maximum": 65535}}, "required": ["host", "port"], "additionalProperties": False},
        "debug": {"type": "boolean"}}, "required": ["server", "debug"],
        "additionalProperties": False}),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt(what: str, disaggregated: bool) -> str:
    """Short: under the router's 64 uncached tokens (colocated). Long: a unique preamble
    puts it over them (prefilled on the prefill worker)."""
    ask = f"Reply with JSON describing {what}."
    if not disaggregated:
        return ask
    tag = uuid.uuid4().hex
    context = " ".join(f"note {i} of {tag[:8]} is background only;" for i in range(16))
    return f"{context} {ask}"


def answer(client: openai.OpenAI, model: str, messages: list[dict[str, str]],
           stream: bool, max_tokens: int, **extra: Any) -> tuple[str, str | None]:  # fmt: skip
    """The text and finish reason, streamed or whole."""
    args: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    args["temperature"] = 0.7
    args["seed"] = 7
    if stream:
        text, reason = [], None
        for chunk in client.chat.completions.create(stream=True, **args, **extra):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason
    done = client.chat.completions.create(**args, **extra)
    return done.choices[0].message.content or "", done.choices[0].finish_reason


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": S}, "required": ["city"],
                       "additionalProperties": False},
    },
}  # fmt: skip
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def record(results: list[dict[str, Any]], kind: str, ok: bool, detail: str) -> None:
    results.append({"kind": kind, "ok": ok, "detail": detail})
    print(f"{'ok  ' if ok else 'FAIL'} {kind:34s} {detail[:110]}", flush=True)


def calls_valid(calls: list[Any], names: set[str]) -> bool:
    """Every call names one of `names`, has an id, and its arguments validate."""
    try:
        for call in calls:
            assert call.id and call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    except (AssertionError, ValueError, jsonschema.ValidationError):
        return False
    return bool(calls)


def streamed_calls(client: openai.OpenAI, **args: Any) -> tuple[list[tuple[str, str]], str | None]:
    """Tool-call deltas joined by index: [(name, arguments)], and the finish reason."""
    joined: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            reason = chunk.choices[0].finish_reason or reason
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, text = joined.setdefault(delta.index, ["", ""])
            if delta.function and delta.function.name:
                joined[delta.index][0] = name + delta.function.name
            if delta.function and delta.function.arguments:
                joined[delta.index][1] = text + delta.function.arguments
    return [(n, a) for _, (n, a) in sorted(joined.items())], reason


def check_tools(client: openai.OpenAI, model: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    tools = [WEATHER, TIME]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_time"})):
        for parallel in (None, False):  # None: OpenAI's default, parallel calls on
            label = choice if isinstance(choice, str) else "named"
            label += "" if parallel is None else " parallel=False"
            for disaggregated in (False, True):
                msgs = [{"role": "user", "content": prompt("the weather in Paris", disaggregated)}]
                args: dict[str, Any] = {
                    "model": model,
                    "messages": msgs,
                    "tools": tools,
                    "tool_choice": choice,
                    "max_tokens": 300,
                    "seed": 3,
                }
                if parallel is not None:
                    args["parallel_tool_calls"] = parallel
                whole = client.chat.completions.create(**args)
                calls = whole.choices[0].message.tool_calls or []
                reason = whole.choices[0].finish_reason
                # With parallel calls SmolLM2 may go on calling until max_tokens cuts it: the
                # answer is then the calls written whole, finish_reason length.
                reasons = ("tool_calls",) if parallel is False else ("tool_calls", "length")
                ok = calls_valid(calls, names) and reason in reasons
                ok = ok and (parallel is None or len(calls) == 1)
                record(
                    results,
                    f"tools {label} disagg={disaggregated}",
                    ok,
                    f"{reason} {len(calls)} calls "
                    + str([(c.function.name, c.function.arguments) for c in calls])
                    + ("" if calls else f" content={whole.choices[0].message.content!r}"),
                )
                streamed, streamed_reason = streamed_calls(client, **args)
                same = streamed == [(c.function.name, c.function.arguments) for c in calls]
                record(
                    results,
                    f"tools {label} streamed disagg={disaggregated}",
                    same and streamed_reason == reason,
                    f"{streamed_reason} {streamed}",
                )
    msgs = [{"role": "user", "content": "What is the weather in Rome, in celsius?"}]
    auto = client.chat.completions.create(model=model, messages=msgs, tools=tools,
                                          tool_choice="auto", max_tokens=80, seed=3)
    message = auto.choices[0].message
    ok = calls_valid(message.tool_calls or [], set(PARAMS)) if message.tool_calls else bool(
        message.content
    )
    record(results, "tools auto (text or calls)", ok,
           str(message.tool_calls or message.content))  # fmt: skip
    first = client.chat.completions.create(model=model, messages=msgs, tools=tools,
                                           tool_choice="required", max_tokens=300, seed=3,
                                           parallel_tool_calls=False)
    call = (first.choices[0].message.tool_calls or [None])[0]
    if call is None:
        record(results, "tools second turn", False, "no call in the first turn")
        return results
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "clear"}'},
    ]  # fmt: skip
    second = client.chat.completions.create(model=model, messages=history, tools=tools,
                                            max_tokens=60, temperature=0)  # fmt: skip
    reply = second.choices[0].message
    record(results, "tools second turn (after the result)", bool(reply.content or
           reply.tool_calls), str(reply.content or reply.tool_calls))  # fmt: skip
    return results


def check_responses(client: openai.OpenAI, model: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    question = "What is the capital of France?"
    tool = {"type": "function", **WEATHER["function"]}  # the Responses API's flat shape
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMAS[1][1], "strict": True}
    for stream in (False, True):
        def ask(stream: bool = stream, **args: Any) -> tuple[str, list[Any]]:
            """The output text and function calls, streamed or whole."""
            if not stream:
                r = client.responses.create(model=model, max_output_tokens=120, **args)
                calls = [o for o in r.output if o.type == "function_call"]
                return r.output_text, calls
            text, calls = [], []
            for event in client.responses.create(model=model, max_output_tokens=120,
                                                 stream=True, **args):  # fmt: skip
                if event.type == "response.output_text.delta":
                    text.append(event.delta)
                elif event.type == "response.output_item.done" and (
                    event.item.type == "function_call"
                ):
                    calls.append(event.item)
            return "".join(text), calls

        text, _ = ask(input=question, temperature=0)
        record(results, f"responses README question stream={stream}", "Paris" in text, text)
        _, calls = ask(input="The weather in Oslo?", tools=[tool], tool_choice="required")
        ok = bool(calls) and all(
            c.name == "get_weather" and _valid(json.loads(c.arguments), PARAMS["get_weather"])
            for c in calls
        )
        record(results, f"responses tool call stream={stream}", ok,
               str([(c.name, c.arguments) for c in calls]))  # fmt: skip
        text, _ = ask(input="Describe a city as JSON.", text={"format": fmt}, temperature=0.7)
        try:
            ok = _valid(json.loads(text), SCHEMAS[1][1])
        except ValueError:
            ok = False
        record(results, f"responses json_schema stream={stream}", ok, text)
    return results


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: tandem up's)")
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    http = free_port()
    cmd = [str(REPO_ROOT / ".venv" / "bin" / "tandem"), "up", "--port", str(free_port())]
    cmd += ["--http-port", str(http), "--redis-port", "0"]
    if args.model:
        cmd += ["--model", args.model]
    log = tempfile.NamedTemporaryFile("w", prefix="check-structured-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    results: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"tandem up did not start (log {log.name})") from None
                time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", timeout=300)
        model = client.models.list().data[0].id
        for what, schema in SCHEMAS:
            fmt = {"type": "json_schema",
                   "json_schema": {"name": "answer", "schema": schema, "strict": True}}  # fmt: skip
            for disaggregated in (False, True):
                for stream in (False, True):
                    msgs = [{"role": "user", "content": prompt(what, disaggregated)}]
                    text, reason = answer(client, model, msgs, stream, args.max_tokens,
                                          response_format=fmt)  # fmt: skip
                    problem = ""
                    try:
                        jsonschema.validate(json.loads(text), schema)
                    except (ValueError, jsonschema.ValidationError) as exc:
                        problem = f"{type(exc).__name__}: {str(exc)[:120]}"
                    results.append({"kind": "json_schema", "what": what,
                                    "disaggregated": disaggregated, "stream": stream,
                                    "finish_reason": reason, "text": text, "ok": not problem,
                                    "problem": problem})  # fmt: skip
                    mark = "ok  " if not problem else "FAIL"
                    print(f"{mark} {what:22s} disagg={disaggregated!s:5} stream={stream!s:5} "
                          f"{reason}: {text[:70]!r} {problem}", flush=True)  # fmt: skip
        checks = [
            ("regex", {"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"},
             lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", t) is not None),
            ("choice", {"guided_choice": ["alpha", "beta", "gamma"]},
             lambda t: t in ("alpha", "beta", "gamma")),
        ]  # fmt: skip
        for kind, extra, valid in checks:
            for disaggregated in (False, True):
                msgs = [{"role": "user", "content": prompt(f"a {kind}", disaggregated)}]
                text, reason = answer(client, model, msgs, False, 32, extra_body=extra)
                ok = bool(valid(text))
                results.append({"kind": kind, "disaggregated": disaggregated, "stream": False,
                                "finish_reason": reason, "text": text, "ok": ok})  # fmt: skip
                print(f"{'ok  ' if ok else 'FAIL'} {kind:22s} disagg={disaggregated!s:5} "
                      f"{reason}: {text!r}", flush=True)  # fmt: skip
        results += check_tools(client, model)
        results += check_responses(client, model)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    passed = sum(r["ok"] for r in results)
    print(f"{passed}/{len(results)} answers conform ({len(SCHEMAS)} schemas x colocated/"
          f"disaggregated x streamed/whole, regex and choice, tools, Responses)")
    write_json(RESULTS_DIR / "structured_default_model.json", {
        "command": "python benchmarks/check_structured.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(), "passed": passed, "total": len(results), "results": results,
    }, indent=1)  # fmt: skip
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
