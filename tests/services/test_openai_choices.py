"""Several choices per OpenAI request against `tandem up`, through the `openai` client: lists
of prompts and echo on /v1/completions, n > 1 on both endpoints (seeded choices differ and
repeat; one prefill serves the n sequences), streamed and whole answers alike."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
import uuid
from collections import defaultdict

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import TandemClient
from tandem.config import DEFAULT_BLOCK_SIZE
from tandem.model.config import ModelConfig
from tandem.services.router.openai.choices import derive_seed
from tandem.services.up import Cluster
from tandem.tokenizer.tokenizer import Tokenizer
from tandem.v1 import worker_pb2 as wpb
from tests.services.workers import assert_all_free, worker_stub

BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # the workers'


def long_prompt() -> str:
    """Over the router's 64 uncached tokens and new each time: prefilled on the prefill
    worker and handed over."""
    tag = uuid.uuid4().hex
    return f"{tag} " + " ".join(f"item {i} of the list {tag}, then" for i in range(30))


@pytest.fixture(scope="module")
def tokenizer(cluster: Cluster) -> Tokenizer:
    return Tokenizer.from_dir(cluster.config.model_dir)


def test_a_list_of_prompts_gets_one_choice_each_as_alone(
    client: openai.OpenAI, grpc_client: TandemClient, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode("The lazy dog", add_special_tokens=False)
    prompts: list[str | list[int]] = ["The quick brown fox", ids, long_prompt()]
    refs = [grpc_client.generate(p, max_tokens=6, temperature=0.0) for p in prompts]
    out = client.completions.create(
        model="",
        prompt=prompts,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert [c.finish_reason for c in out.choices] == [r.finish_reason for r in refs]
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(r.prompt_tokens for r in refs)
    assert out.usage.completion_tokens == sum(r.completion_tokens for r in refs)


def test_echo_puts_the_prompt_before_each_choice(
    client: openai.OpenAI, grpc_client: TandemClient, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(" the lazy dog", add_special_tokens=False)
    refs = [grpc_client.generate(p, max_tokens=5, temperature=0.0) for p in ("Once upon", ids)]
    out = client.completions.create(
        model="", prompt=["Once upon", ids], max_tokens=5, temperature=0, echo=True
    )
    assert [c.text for c in out.choices] == [
        "Once upon" + refs[0].text,
        tokenizer.decode(ids) + refs[1].text,
    ]
    streamed = client.completions.create(
        model="", prompt="Once upon", max_tokens=5, temperature=0, echo=True, stream=True
    )
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert pieces[0] == "Once upon"  # the echo comes first, as its own chunk
    assert "".join(pieces) == "Once upon" + refs[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="", prompt="x", echo=True, logprobs=1)
    assert err.value.param == "echo"


def test_n_seeded_choices_differ_repeat_and_are_the_derived_seeds_answers(
    client: openai.OpenAI, grpc_client: TandemClient
) -> None:
    chat = [{"role": "user", "content": "Tell me a story"}]
    kwargs = {"model": "", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    out = client.chat.completions.create(messages=chat, n=4, **kwargs)  # type: ignore[call-overload]
    again = client.chat.completions.create(messages=chat, n=4, **kwargs)  # type: ignore[call-overload]
    texts = [c.message.content for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1, texts
    # Choice i is the request seeded with derive_seed(seed, i): choice 0 is the n=1 answer.
    refs = [
        grpc_client.generate(messages=chat, max_tokens=8, temperature=1.0, seed=derive_seed(11, i))
        for i in range(4)
    ]
    assert texts == [r.text for r in refs]
    assert out.usage is not None
    assert out.usage.prompt_tokens == refs[0].prompt_tokens  # the prompt once, as OpenAI
    assert out.usage.completion_tokens == sum(r.completion_tokens for r in refs)


def test_n_streamed_reassembles_to_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = {"model": "", "prompt": ["Hello", "World"], "max_tokens": 6, "seed": 3, "n": 2}
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )  # type: ignore[call-overload]
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_n_sequences_share_one_prefill(
    cluster: Cluster, client: openai.OpenAI, grpc_client: TandemClient
) -> None:
    prompt = long_prompt()
    num_blocks = -(-len(grpc_client.tokenize(prompt)) // BLOCK_SIZE)
    config = ModelConfig.from_dir(cluster.config.model_dir)
    block_bytes = BLOCK_SIZE * config.kv_elements_per_token * 4  # float32 (up_cluster)
    decode = cluster.metrics_addresses["decode-0"]
    pulled, paths = counter(decode, "tandem_worker_kv_transfer_bytes_total"), placements(cluster)
    out = client.completions.create(
        model="", prompt=prompt, n=4, max_tokens=4, temperature=1.0, seed=5
    )
    pulled = counter(decode, "tandem_worker_kv_transfer_bytes_total") - pulled
    after = placements(cluster)
    assert len(out.choices) == 4 and len({c.text for c in out.choices}) > 1
    # The prompt is computed and handed over once. The first sequence is prefilled on the
    # prefill worker; its siblings go where the prefix index says the prompt is: as a rule
    # the decode worker that pulled it (colocated, served from its cache), or, when its
    # blocks are not indexed yet, the prefill worker, which finds them cached and computes
    # the last, partial block, of which the decode worker then pulls only that block.
    num_prefills = after["disaggregated"] - paths["disaggregated"]
    assert num_prefills >= 1 and num_prefills + after["colocated"] - paths["colocated"] == 4
    assert pulled <= (num_blocks + num_prefills - 1) * block_bytes, (pulled, num_prefills)


def counter(address: str, name: str) -> float:
    """A sample of a process's /metrics (0 before its first)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def placements(cluster: Cluster) -> dict[str, float]:
    """The router's placements so far, by path (disaggregated, colocated)."""
    address = cluster.metrics_addresses["router"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    paths: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_router_routing_decisions_total":
                paths[sample.labels["path"]] += sample.value
    return paths


def router_counter(cluster: Cluster, name: str, **labels: str) -> float:
    """A counter of the router's /metrics (0 before its first sample)."""
    address = cluster.metrics_addresses["router"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name + "_total" and sample.labels == labels:
                return float(sample.value)
    return 0.0


def test_disconnect_mid_stream_aborts_every_choice(cluster: Cluster, client: openai.OpenAI) -> None:
    aborted = router_counter(cluster, "tandem_router_requests", outcome="aborted", code="OK")
    stream = client.completions.create(
        model="", prompt=["Once upon a time", long_prompt()], n=2, max_tokens=1500,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    seen: set[int] = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices if c.text)
        if seen == {0, 1, 2, 3}:
            break
    stream.close()
    assert_all_free(cluster)  # both workers: no block, lease or request left
    after = router_counter(cluster, "tandem_router_requests", outcome="aborted", code="OK")
    assert after - aborted == 4


def test_one_refused_choice_refuses_the_request_and_ends_the_others(
    cluster: Cluster, client: openai.OpenAI
) -> None:
    too_long = [5] * 5000  # more token ids than the context
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="", prompt=["Once upon a time", too_long], max_tokens=1500,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    assert "token_ids: 5000 tokens" in err.value.message
    assert_all_free(cluster)


def test_disconnect_before_a_whole_answer_aborts_every_choice(cluster: Cluster) -> None:
    aborted = router_counter(cluster, "tandem_router_requests", outcome="aborted", code="OK")
    body = {"prompt": ["Once upon a time", long_prompt()], "n": 2, "max_tokens": 1500,
            "ignore_eos": True}  # fmt: skip
    raw = json.dumps(body).encode()
    host, port = cluster.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(raw)}\r\n\r\n"
        )
        sock.sendall(head.encode() + raw)
        decode, _ = worker_stub(cluster, "decode")
        deadline = time.monotonic() + 30
        while decode.GetStats(wpb.GetStatsRequest()).num_running < 4:  # every choice runs
            assert time.monotonic() < deadline, "the choices never all started"
            time.sleep(0.02)
    assert_all_free(cluster)
    after = router_counter(cluster, "tandem_router_requests", outcome="aborted", code="OK")
    assert after - aborted == 4


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_n_choices_with_forced_tool_calls_stream_as_the_whole_answer(
    client: openai.OpenAI,
) -> None:
    kwargs = {"model": "", "messages": [{"role": "user", "content": "Weather?"}], "n": 3,
              "tools": [WEATHER_TOOL], "tool_choice": "required", "temperature": 1.0,
              "seed": 7, "max_tokens": 100}  # fmt: skip
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    want = {
        c.index: [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        for c in whole.choices
    }
    assert all(reason == "tool_calls" for reason in (c.finish_reason for c in whole.choices))
    assert all(calls and {n for n, _ in calls} == {"get_weather"} for calls in want.values())
    calls: dict[int, dict[int, list[str]]] = defaultdict(dict)
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                name, args = calls[c.index].setdefault(delta.index, ["", ""])
                calls[c.index][delta.index] = [
                    name + (delta.function.name or ""),
                    args + (delta.function.arguments or ""),
                ]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert {i: [tuple(v) for _, v in sorted(d.items())] for i, d in calls.items()} == want
