"""The public plane with real processes: API keys naming tenants, scopes, server TLS with a
certificate made here, request ids a tenant cannot see across, and prefix caches that one
tenant cannot probe for another's prompts."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client import AsyncTandemClient, Result, TandemClient, TandemError
from tests.services.certs import make_ca, make_cert
from tests.services.processes import free_port

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-0123456789"
KEY_READ = "read-only-key-0123456789"


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, redis_server, procs, tmp_path_factory) -> Iterator[SimpleNamespace]:  # type: ignore[no-untyped-def]
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make certificates")
    d = tmp_path_factory.mktemp("public-auth")
    keys = d / "keys"
    keys.write_text(
        f"# key tenant scopes\n{KEY_A} acme generate\n{KEY_B} globex\n{KEY_READ} acme read\n"
    )
    make_ca(d, "ca")
    make_cert(d, "router", "ca")
    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_server.url)
    r.flushall()
    r.close()
    url = redis_server.url
    workers = [
        procs.worker("prefill", tiny_model_dir, url, "pub-p0"),
        procs.worker("decode", tiny_model_dir, url, "pub-d0"),
    ]
    common = ("--api-keys-file", str(keys), "--disagg-min-uncached-tokens", "32")
    plain = procs.router(tiny_model_dir, url, *common)
    https_port = free_port()
    tls = procs.router(
        tiny_model_dir, url, *common,
        "--tls-cert-file", str(d / "router.pem"), "--tls-key-file", str(d / "router.key"),
        "--http-port", str(https_port),
    )  # fmt: skip
    yield SimpleNamespace(
        plain=plain[1], tls=tls[1], ca=str(d / "ca.pem"), https=f"127.0.0.1:{https_port}"
    )
    procs.stop(plain[0], tls[0], *(p for p, _ in workers))


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        call()
    except TandemError as exc:
        return exc.code
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("key", "code"),
    [
        ("", grpc.StatusCode.UNAUTHENTICATED),
        ("not-a-key-at-all-0000", grpc.StatusCode.UNAUTHENTICATED),
        (KEY_READ, grpc.StatusCode.PERMISSION_DENIED),
        (KEY_A, grpc.StatusCode.OK),
    ],
)
def test_every_public_rpc_needs_a_key_with_the_generate_scope(fleet, key, code) -> None:
    with TandemClient(fleet.plain, timeout_s=30, api_key=key) as c:
        assert code_of(lambda: c.generate([5, 6, 7], max_tokens=2)) == code
        assert code_of(lambda: c.tokenize("hello")) == code
        assert code_of(c.list_models) == code
        if code != grpc.StatusCode.OK:
            assert code_of(lambda: c.abort("x")) == code


def test_health_stays_open_without_a_key(fleet) -> None:
    with grpc.insecure_channel(fleet.plain) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_refusal_does_not_echo_the_key(fleet) -> None:
    with TandemClient(fleet.plain, timeout_s=30, api_key="wrong-but-long-key-xyz") as c:
        with pytest.raises(TandemError) as info:
            c.generate([5], max_tokens=1)
    assert "wrong-but-long-key-xyz" not in info.value.message


def test_ids_abort_and_duplicates_are_per_tenant(fleet) -> None:
    async def scenario() -> tuple[bool, Result, Result, bool]:
        async with (
            AsyncTandemClient(fleet.plain, timeout_s=60, api_key=KEY_A) as a,
            AsyncTandemClient(fleet.plain, timeout_s=60, api_key=KEY_B) as b,
        ):
            started = asyncio.Event()
            result_a = Result()

            async def run_a() -> Result:
                async for _ in a.stream(
                    [5, 6, 7], result=result_a, request_id="job-1", max_tokens=400,
                    ignore_eos=True, temperature=0.0,
                ):  # fmt: skip
                    started.set()
                return result_a

            task = asyncio.create_task(run_a())
            await asyncio.wait_for(started.wait(), 60)
            b_abort = await b.abort("job-1")  # A's id: not B's to see or stop
            b_same = await b.generate([8, 9], request_id="job-1", max_tokens=4)  # B's own
            done = await task
            return b_abort, b_same, done, await a.abort("job-1")  # finished: gone

    b_abort, b_same, done_a, late = asyncio.run(scenario())
    assert b_abort is False
    assert b_same.finish_reason == "length" and b_same.request_id == "job-1"
    assert done_a.finish_reason == "length" and len(done_a.token_ids) == 400
    assert late is False


def test_a_tenant_cannot_observe_another_tenants_cache_hits(fleet) -> None:
    prompt = list(range(20, 220))  # long: disaggregated, 12 full blocks

    def run(key: str) -> Result:
        with TandemClient(fleet.plain, timeout_s=60, api_key=key) as c:
            return c.generate(prompt, max_tokens=4, temperature=0.0)

    first, again = run(KEY_A), run(KEY_A)
    other = run(KEY_B)
    assert first.cached_prompt_tokens == 0
    assert again.cached_prompt_tokens > 0 and again.route_cached_tokens > 0  # A's own hits
    assert other.cached_prompt_tokens == 0 and other.route_cached_tokens == 0
    assert other.token_ids == first.token_ids  # apart, not different


def test_tls_router_serves_a_client_that_trusts_its_ca_only(fleet) -> None:
    with TandemClient(fleet.tls, timeout_s=30, api_key=KEY_A, tls=fleet.ca) as c:
        assert c.generate([5, 6, 7], max_tokens=3).finish_reason == "length"
    with TandemClient(fleet.tls, timeout_s=10, api_key=KEY_A) as c:  # plaintext to a TLS port
        assert code_of(lambda: c.generate([5], max_tokens=1)) == grpc.StatusCode.UNAVAILABLE
    with TandemClient(fleet.tls, timeout_s=10, api_key=KEY_A, tls=True) as c:  # system CAs
        assert code_of(lambda: c.generate([5], max_tokens=1)) == grpc.StatusCode.UNAVAILABLE


def test_tls_router_serves_https_with_the_same_certificate_and_keys(fleet) -> None:
    base_url = f"https://{fleet.https}/v1"
    trusting = ssl.create_default_context(cafile=fleet.ca)
    http_client = openai.DefaultHttpxClient(verify=trusting)
    with openai.OpenAI(
        base_url=base_url, api_key=KEY_A, max_retries=0, http_client=http_client
    ) as c:
        out = c.completions.create(model="", prompt=[5, 6, 7], max_tokens=3)
        assert out.choices[0].finish_reason == "length"
        with pytest.raises(openai.PermissionDeniedError):  # the gRPC API's keys and scopes
            c.with_options(api_key=KEY_READ).completions.create(model="", prompt="x")
    # Plain HTTP to the TLS port, or a client that does not trust the CA: no answer.
    for url, verify in ((f"http://{fleet.https}/v1", True), (base_url, True)):
        client = openai.DefaultHttpxClient(verify=verify)
        with openai.OpenAI(base_url=url, api_key=KEY_A, max_retries=0, http_client=client) as c:
            with pytest.raises(openai.APIConnectionError):
                c.completions.create(model="", prompt="x", max_tokens=1)
