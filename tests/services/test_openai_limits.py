"""The OpenAI HTTP API's refusals with real processes and the real `openai` client: API keys
and scopes (401, 403) shared with the gRPC API, admission limits with pushback (429 and
Retry-After), a duplicate X-Request-Id (409), and no worker to serve (503)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import redis as redis_lib

from tandem.client import TandemClient, TandemError
from tests.services.processes import free_port

KEY = "oai-generate-key-0123456789"
KEY_READ = "oai-read-only-key-0123456789"
CHAT: Any = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, redis_server, procs, tmp_path_factory) -> Iterator[SimpleNamespace]:  # type: ignore[no-untyped-def]
    keys = tmp_path_factory.mktemp("oai-keys") / "keys"
    keys.write_text(f"{KEY} acme generate\n{KEY_READ} acme read\n")
    r = redis_lib.Redis.from_url(redis_server.url)
    r.flushall()
    r.close()
    url = redis_server.url
    worker = procs.worker("decode", tiny_model_dir, url, "oai-d0", "--transport", "local")
    http, ghost_http = free_port(), free_port()
    keyed = procs.router(
        tiny_model_dir, url, "--api-keys-file", str(keys), "--max-inflight", "1",
        "--http-port", str(http),
    )  # fmt: skip
    # Serves a model no worker has registered: every request finds no decode worker.
    ghost = procs.router(
        tiny_model_dir, url, "--model-id", "ghost", "--http-port", str(ghost_http)
    )
    yield SimpleNamespace(
        grpc=keyed[1],
        base_url=f"http://127.0.0.1:{http}/v1",
        ghost_url=f"http://127.0.0.1:{ghost_http}/v1",
    )
    procs.stop(keyed[0], ghost[0], worker[0])


def client(base_url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def get(url: str, key: str | None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_key_decides_like_grpc(fleet: SimpleNamespace) -> None:
    with client(fleet.base_url) as c:
        out = c.chat.completions.create(model="", messages=CHAT, max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
    with client(fleet.base_url, "not-a-key-0000000000") as c:
        with pytest.raises(openai.AuthenticationError) as unauthenticated:
            c.chat.completions.create(model="", messages=CHAT, max_tokens=3)
    assert unauthenticated.value.status_code == 401
    assert unauthenticated.value.code == "invalid_api_key"
    assert "not-a-key" not in str(unauthenticated.value.body)
    with client(fleet.base_url, KEY_READ) as c:
        with pytest.raises(openai.PermissionDeniedError) as denied:
            c.completions.create(model="", prompt="x", max_tokens=3)
    assert "lacks scope generate" in denied.value.message
    # The same keys on the gRPC API.
    with TandemClient(fleet.grpc, api_key=KEY_READ) as g, pytest.raises(TandemError):
        g.generate("x", max_tokens=1)


def test_models_needs_a_key_and_health_does_not(fleet: SimpleNamespace) -> None:
    assert get(f"{fleet.base_url}/models", None)[0] == 401
    status, body = get(f"{fleet.base_url}/models", KEY)
    assert status == 200 and body["object"] == "list"
    assert get(fleet.base_url.removesuffix("/v1") + "/health", None) == (200, {"status": "ok"})


def test_over_max_inflight_is_429_with_retry_after(fleet: SimpleNamespace) -> None:
    with client(fleet.base_url) as c:
        holding = c.completions.create(
            model="", prompt="hold", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(holding))  # admitted and streaming: the router's one slot is taken
        try:
            with pytest.raises(openai.RateLimitError) as limited:
                c.completions.create(model="", prompt="x", max_tokens=2)
            response = limited.value.response
            assert response.status_code == 429
            assert int(response.headers["retry-after-ms"]) > 0
            assert int(response.headers["retry-after"]) >= 1
            assert "max_inflight 1" in limited.value.message
        finally:
            holding.close()


def test_a_running_request_id_is_409(fleet: SimpleNamespace) -> None:
    headers = {"X-Request-Id": "job-7"}
    with client(fleet.base_url) as c:
        # Retried on 429: the previous test's request may still be leaving its slot.
        first = c.with_options(default_headers=headers, max_retries=5).completions.create(
            model="", prompt="hold", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
        )
        assert first.response.headers["x-request-id"] == "job-7"
        next(iter(first))
        try:
            with pytest.raises(openai.ConflictError) as conflict:
                c.with_options(default_headers=headers).completions.create(
                    model="", prompt="x", max_tokens=2
                )
            assert "job-7" in conflict.value.message
        finally:
            first.close()


def test_no_worker_is_503(fleet: SimpleNamespace) -> None:
    with client(fleet.ghost_url) as c:
        with pytest.raises(openai.InternalServerError) as unavailable:
            c.chat.completions.create(model="ghost", messages=CHAT, max_tokens=2)
    assert unavailable.value.status_code == 503
    assert unavailable.value.type == "service_unavailable"  # type: ignore[attr-defined]
    assert unavailable.value.response.headers["retry-after"] == "1"
