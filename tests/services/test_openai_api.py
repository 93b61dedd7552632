"""The OpenAI HTTP API with the real clients: the `openai` package (sync, async, streaming)
and curl, against `tandem up`; answers token-identical to the gRPC API for the same greedy
request; a client that disconnects leaves nothing on either worker."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import TandemClient
from tandem.services.up import Cluster
from tandem.tokenizer.tokenizer import Tokenizer
from tandem.v1 import worker_pb2 as wpb
from tests.services.workers import assert_all_free, worker_stub

# Over the router's 64-token threshold under the tiny model's tokenizer: disaggregated.
LONG = " ".join(f"item {i} of the list, then" for i in range(40))
CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": LONG},
    ],
]
PROMPTS = ["The quick brown fox", LONG]
MAX_TOKENS = 2000  # with the prompt, up to the tiny model's context of 2048


@pytest.fixture(scope="module")
def base_url(cluster: Cluster) -> str:
    return f"http://{cluster.http_address}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster: Cluster) -> Iterator[TandemClient]:
    with TandemClient(cluster.router_address, timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(cluster: Cluster) -> Tokenizer:
    return Tokenizer.from_dir(cluster.config.model_dir)


def token_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def test_models_and_health(client: openai.OpenAI, cluster: Cluster, model: str) -> None:
    assert [m.id for m in client.models.list().data] == [Path(cluster.config.model_dir).name]
    assert model == Path(cluster.config.model_dir).name
    out = subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", f"http://{cluster.http_address}/health"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    body, code = out.stdout.rsplit("\n", 1)
    assert (code, json.loads(body)) == ("200", {"status": "ok"})


@pytest.mark.parametrize("messages", CHATS, ids=["short", "long-multiturn"])
def test_chat_is_token_identical_to_grpc(
    client: openai.OpenAI,
    grpc_client: TandemClient,
    tokenizer: Tokenizer,
    model: str,
    messages: list[dict[str, str]],
) -> None:
    ref = grpc_client.generate(messages=messages, max_tokens=12, temperature=0.0)
    out = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        logprobs=True,  # type: ignore[arg-type]
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.token for e in choice.logprobs.content] == token_texts(tokenizer, ref.token_ids)
    assert choice.finish_reason == ref.finish_reason
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        ref.prompt_tokens,
        ref.completion_tokens,
    )
    assert out.usage.total_tokens == ref.prompt_tokens + ref.completion_tokens


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_completion_is_token_identical_to_grpc(
    client: openai.OpenAI,
    grpc_client: TandemClient,
    tokenizer: Tokenizer,
    model: str,
    prompt: str,
) -> None:
    ref = grpc_client.generate(prompt, max_tokens=10, temperature=0.0, logprobs=2)
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text == ref.text
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == token_texts(tokenizer, ref.token_ids)
    assert choice.logprobs.token_logprobs == pytest.approx([lp for _, lp, _ in ref.logprobs])
    # OpenAI's shape keys alternatives by their text (two ids of one text share a key).
    text_of = tokenizer.decode
    expected = [{text_of([i], False): lp for i, lp in top} for _, _, top in ref.logprobs]
    assert choice.logprobs.top_logprobs == [pytest.approx(e) for e in expected]
    # Token ids as the prompt: the same answer.
    by_ids = client.completions.create(
        model=model, prompt=tokenizer.encode(prompt), max_tokens=10, temperature=0
    )
    assert by_ids.choices[0].text == ref.text


def test_streaming_chat_with_usage_equals_the_whole_answer(
    client: openai.OpenAI, model: str
) -> None:
    messages: Any = CHATS[1]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishing[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_async_client_streams_concurrently(base_url: str, model: str) -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as c:

            async def streamed(prompt: str) -> str:
                stream = await c.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
                )
                return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

            async def whole(prompt: str) -> str:
                out = await c.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0
                )
                return out.choices[0].text

            prompts = [f"{p} number {i}" for i in range(3) for p in PROMPTS]
            streams = await asyncio.gather(*(streamed(p) for p in prompts))
            wholes = await asyncio.gather(*(whole(p) for p in prompts))
            return list(streams), list(wholes)

    streams, wholes = asyncio.run(scenario())
    assert streams == wholes
    assert all(streams)


def test_seeded_sampling_and_stop_strings(
    client: openai.OpenAI, grpc_client: TandemClient, model: str
) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=model, prompt="Once upon", max_tokens=12, temperature=1.0, top_p=0.9, seed=seed
        )
        return out.choices[0].text

    ref = grpc_client.generate("Once upon", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert sample(7) == sample(7) == ref.text
    greedy = client.completions.create(
        model=model, prompt="Once upon", max_tokens=12, temperature=0
    )
    text = greedy.choices[0].text
    stop = text[6:9]
    assert stop and stop in text
    stopped = client.completions.create(
        model=model, prompt="Once upon", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_curl_streams_server_sent_events(cluster: Cluster, model: str) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": True}
    out = subprocess.run(
        ["curl", "-sS", "-N", f"http://{cluster.http_address}/v1/completions",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    events = [line[len("data: ") :] for line in out.stdout.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = subprocess.run(
        ["curl", "-sS", f"http://{cluster.http_address}/v1/completions",
         "-H", "Content-Type: application/json", "-d", json.dumps({**body, "stream": False})],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    answer = json.loads(whole.stdout)
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 5


def http_status(cluster: Cluster, method: str, path: str, body: bytes | None) -> tuple[int, Any]:
    args = ["curl", "-sS", "-X", method, "-w", "\n%{http_code}"]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    out = subprocess.run(
        [*args, f"http://{cluster.http_address}{path}"],
        input=body, capture_output=True, timeout=60, check=True,
    )  # fmt: skip
    text, code = out.stdout.decode().rsplit("\n", 1)
    return int(code), json.loads(text)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "says"),
    [
        ("/v1/chat/completions", b"{not json", 400, "body", "not valid JSON"),
        ("/v1/chat/completions", b"[]", 400, "body", "JSON object"),
        ("/v1/chat/completions", {}, 400, "messages", "non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
         "messages[0].role", "one of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 65}, 400,
         "n", "[1, 64]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "tools": [{"type": "function"}]}, 400, "tools[0].function", "JSON object, got null"),
        ("/v1/completions", {"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools",
         "not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "temperature": "hot"}, 400, "temperature", "finite number"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "max_tokens": 0}, 400, "max_tokens", ">= 1"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "top_logprobs": 3}, 400, "top_logprobs", "logprobs: true"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "stream_options": {"include_usage": True}}, 400, "stream_options", "stream is true"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
         "model": "gpt-4"}, 404, "model", "does not exist"),
        ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt", "[1] must not be empty"),
        ("/v1/completions", {"prompt": "x" * 2_000_000}, 400, None, "cannot fit"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, None, "temperature"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo",
         "echo with logprobs"),
        ("/v1/embeddings", {"input": "x"}, 404, None, "Not Found"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(
    cluster: Cluster, path: str, body: Any, status: int, param: str | None, says: str
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, answer = http_status(cluster, "POST", path, raw)
    assert code == status, answer
    error = answer["error"]
    assert says in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_wrong_method_is_405_in_openai_shape(cluster: Cluster) -> None:
    code, answer = http_status(cluster, "GET", "/v1/chat/completions", None)
    assert code == 405
    assert "Method Not Allowed" in answer["error"]["message"]


def test_openai_client_raises_the_matching_error_classes(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="", prompt="x", n=65)
    assert "n: must be in [1, 64], got 65" in bad.value.message


def decode_running(cluster: Cluster) -> int:
    stub, _ = worker_stub(cluster, "decode")
    return int(stub.GetStats(wpb.GetStatsRequest()).num_running)


def wait_running(cluster: Cluster) -> None:
    deadline = time.monotonic() + 30
    while decode_running(cluster) == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def router_counter(cluster: Cluster, name: str, **labels: str) -> float:
    """A counter of the router's /metrics (0 when it has no such sample yet)."""
    address = cluster.metrics_addresses["router"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name + "_total" and sample.labels == labels:
                return float(sample.value)
    return 0.0


class Aborted:
    """Checks that the requests of a block ended by abort, long before their max_tokens:
    counters of the router, read before and after."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def __enter__(self) -> Aborted:
        self.aborted = router_counter(
            self.cluster, "tandem_router_requests", outcome="aborted", code="OK"
        )
        self.tokens = router_counter(self.cluster, "tandem_router_generation_tokens")
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        assert_all_free(self.cluster)  # both workers: no block, lease or request left
        c = self.cluster
        aborted = router_counter(c, "tandem_router_requests", outcome="aborted", code="OK")
        tokens = router_counter(c, "tandem_router_generation_tokens")
        assert aborted == self.aborted + 1
        # Run to its end, the request would have streamed ~1800 tokens.
        assert tokens - self.tokens < 600


@pytest.mark.parametrize("prompt", PROMPTS, ids=["colocated", "disaggregated"])
def test_disconnect_mid_stream_aborts_on_both_workers(
    client: openai.OpenAI, cluster: Cluster, model: str, prompt: str
) -> None:
    with Aborted(cluster):
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        seen = 0
        for chunk in stream:
            seen += len(chunk.choices[0].text) if chunk.choices else 0
            if seen > 10:
                break
        assert decode_running(cluster) == 1
        stream.close()


def test_disconnect_before_a_whole_answer_aborts_on_both_workers(
    cluster: Cluster, model: str
) -> None:
    body = {"model": model, "prompt": LONG, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    raw = json.dumps(body).encode()
    host, port = cluster.http_address.rsplit(":", 1)
    with Aborted(cluster), socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(raw)}\r\n\r\n"
        )
        sock.sendall(head.encode() + raw)
        wait_running(cluster)
