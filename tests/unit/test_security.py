"""tandem.services.common.security: key files, derived keys, and the auth rules checked by a real
in-process gRPC server (tandem.v1.DecodeWorker on 127.0.0.1) through start_grpc_server."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.services.common.runtime.process import start_grpc_server
from tandem.services.common.security import (
    AuthConfig,
    AuthInterceptor,
    Bearer,
    Internal,
    KeyRing,
    Open,
    Principal,
    Rule,
    bearer_metadata,
    cluster_key,
    current_principal,
    derive_key,
    internal_channel,
    key_id,
    load_secret,
)
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

ALICE = "alice-key-0123456789"
BOB = "bob-key-abcdefghijkl"
ROOT = "root-key-zyxwvutsrqp"
KEYS = f"""\
# tenant keys
{ALICE} alice
{BOB} bob generate,read   # two scopes

{ROOT} ops admin
"""
SECRET = b"cluster-secret-0123456789abcdef"


# -- secrets and keys --------------------------------------------------------------------------


def test_derive_key_is_per_secret_and_purpose() -> None:
    key = derive_key(SECRET, "internal-auth")
    assert len(key) == 32 and key == derive_key(SECRET, "internal-auth")
    assert key != derive_key(SECRET, "kv-handoff")
    assert key != derive_key(SECRET + b"x", "internal-auth")
    assert cluster_key(SECRET) == key.hex() and SECRET.hex() not in cluster_key(SECRET)


def test_load_secret_strips_and_refuses_short_secrets(tmp_path: Path) -> None:
    (tmp_path / "s").write_bytes(SECRET + b"\n")
    assert load_secret(tmp_path / "s") == SECRET
    (tmp_path / "short").write_bytes(b"0123456789abcde\n")
    with pytest.raises(ValueError, match="15 bytes; need >= 16"):
        load_secret(tmp_path / "short")


def test_keyring_parses_tenants_scopes_and_comments() -> None:
    ring = KeyRing.parse(KEYS)
    assert len(ring) == 3 and repr(ring) == "KeyRing(3 keys)"
    assert ring.lookup(ALICE) == Principal(key_id(ALICE), "alice", frozenset({"generate"}))
    assert ring.lookup(BOB) == Principal(key_id(BOB), "bob", frozenset({"generate", "read"}))
    assert ring.lookup(ROOT) == Principal(key_id(ROOT), "ops", frozenset({"admin"}))
    assert key_id(ALICE) == hashlib.sha256(ALICE.encode()).hexdigest()[:8]
    for guess in ("", ALICE[:-1], ALICE + "x", ALICE.upper(), "alice", "\udcff" * 20):
        assert ring.lookup(guess) is None


def test_keyring_confirms_every_hit_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return compare_digest(a, b)

    ring = KeyRing.parse(KEYS)
    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert ring.lookup(BOB) is not None
    assert compared == [(BOB.encode(), BOB.encode())]


@pytest.mark.parametrize(
    "text, message",
    [
        ("# only a comment\n\n", "keys: no keys"),
        ("0123456789abcdef t\nshort-key t\n", "keys line 2: key has 9 characters; need >= 16"),
        ("0123456789abcdef\n", "keys line 1: need `<key> <tenant> [scope,scope]`, got 1 fields"),
        ("0123456789abcdef t a b\n", "got 4 fields"),
        ("0123456789abcdef t\n\n0123456789abcdef u\n", "line 3: duplicate key (also keys line 1)"),
        ("alice 0123456789abcdef!\n", "line 1: key has 5 characters"),
        ("0123456789abcdef al/ice\n", "line 1: tenant must be 1-64 of"),
        ("0123456789abcdef t admin,\n", "line 1: scopes must be 1-64 of"),
    ],
)
def test_keyring_errors_name_the_line_never_the_key(text: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        KeyRing.parse(text, source="keys")
    assert message in str(exc.value)
    assert "0123456789abcdef" not in str(exc.value)


def test_keyring_refuses_a_tenant_field_holding_a_key_without_quoting_it() -> None:
    # Fields swapped: the key sits where the tenant goes and is no name.
    with pytest.raises(ValueError) as exc:
        KeyRing.parse("alice-tenant-key secret/key+0123456789\n", source="keys")
    assert "secret/key" not in str(exc.value)


def test_keyring_load_reads_a_file(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text(KEYS)
    assert KeyRing.load(tmp_path / "keys").lookup(ROOT) is not None


def test_rules_method_beats_service_beats_default() -> None:
    interceptor = AuthInterceptor(
        {"tandem.v1.Admin": Bearer("admin"), "/tandem.v1.Admin/Status": Bearer("admin", "read")}
    )
    assert interceptor.rule("/tandem.v1.Admin/Status") == Bearer("read", "admin")
    assert interceptor.rule("/tandem.v1.Admin/SetRatio") == Bearer("admin")
    assert interceptor.rule("/tandem.v1.Other/Call") == Internal()
    with pytest.raises(ValueError, match="at least one scope"):
        Bearer()


# -- rules over a real server ------------------------------------------------------------------


class Worker(wgrpc.DecodeWorkerServicer):
    """Reports the principal each handler sees: GetStats in worker_id, Decode in both
    messages' request_id; a Decode sends its second message only once `streams` Decode
    calls have started, so concurrent calls interleave."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.all_started = asyncio.Event()

    async def GetStats(
        self, request: wpb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerStats:
        return wpb.WorkerStats(worker_id=_who())

    async def Decode(
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.DecodeResponse]:
        self.streams -= 1
        if self.streams <= 0:
            self.all_started.set()
        yield wpb.DecodeResponse(request_id=_who())
        await self.all_started.wait()
        yield wpb.DecodeResponse(request_id=_who())


def _who() -> str:
    principal = current_principal()
    return "nobody" if principal is None else principal.tenant


Scenario = Callable[[str], Awaitable[Any]]


def serve(
    rules: Mapping[str, Rule],
    scenario: Scenario,
    auth: AuthConfig | None = None,
    keyring: KeyRing | None = None,
    streams: int = 1,
) -> Any:
    """Run `scenario(address)` against a DecodeWorker server with these rules."""

    async def main() -> Any:
        worker = Worker(streams)
        server, port = await start_grpc_server(
            "127.0.0.1",
            0,
            ("tandem.v1.DecodeWorker",),
            lambda s: wgrpc.add_DecodeWorkerServicer_to_server(worker, s),
            health.aio.HealthServicer(),
            auth_rules=rules,
            auth=auth,
            keyring=keyring,
        )
        try:
            return await scenario(f"127.0.0.1:{port}")
        finally:
            await server.stop(0)

    return asyncio.run(main())


async def call(
    address: str, metadata: tuple[tuple[str, str], ...] = ()
) -> str | grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            stats = await wgrpc.DecodeWorkerStub(channel).GetStats(
                wpb.GetStatsRequest(), metadata=metadata, timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return exc
    return str(stats.worker_id)


async def serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def code_of(outcome: str | grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str] | str:
    if isinstance(outcome, grpc.aio.AioRpcError):
        return outcome.code(), outcome.details() or ""
    return outcome


@pytest.fixture
def secret_auth(tmp_path: Path) -> AuthConfig:
    (tmp_path / "secret").write_bytes(SECRET)
    return AuthConfig(cluster_secret_file=str(tmp_path / "secret"))


def test_internal_needs_the_cluster_key_and_health_stays_open(secret_auth: AuthConfig) -> None:
    refused = (
        grpc.StatusCode.UNAUTHENTICATED,
        "/tandem.v1.DecodeWorker/GetStats is internal: it needs the cluster key "
        "(x-tandem-cluster-key) or a client certificate of the cluster CA",
    )

    async def scenario(address: str) -> list[Any]:
        key = cluster_key(SECRET)
        outcomes: list[Any] = [
            code_of(await call(address)),
            code_of(await call(address, (("x-tandem-cluster-key", cluster_key(b"x" * 16)),))),
            code_of(await call(address, (("x-tandem-cluster-key", key[:-1]),))),
            code_of(await call(address, (("x-tandem-cluster-key", SECRET.decode()),))),
            code_of(await call(address, (("x-tandem-cluster-key", key),))),
            await serving(address),
        ]
        async with internal_channel(address, secret_auth) as channel:
            stub = wgrpc.DecodeWorkerStub(channel)
            outcomes.append((await stub.GetStats(wpb.GetStatsRequest(), timeout=10)).worker_id)
            # The client interceptor also covers streams, next to the caller's own metadata.
            stream = stub.Decode(wpb.DecodeRequest(), metadata=(("x-other", "1"),), timeout=10)
            outcomes.append([m.request_id async for m in stream])
        return outcomes

    outcomes = serve({"tandem.v1.DecodeWorker": Internal()}, scenario, auth=secret_auth)
    assert outcomes == [
        refused, refused, refused, refused, "nobody", True, "nobody", ["nobody", "nobody"]
    ]  # fmt: skip


def test_bearer_refuses_unknown_keys_and_missing_scopes() -> None:
    rules: dict[str, Rule] = {
        "tandem.v1.DecodeWorker": Bearer("generate"),
        "/tandem.v1.DecodeWorker/GetStats": Bearer("admin", "read"),
    }

    async def scenario(address: str) -> list[Any]:
        return [
            code_of(await call(address)),
            code_of(await call(address, bearer_metadata("not-a-key-0123456789"))),
            code_of(await call(address, (("authorization", ALICE),))),  # no scheme
            code_of(await call(address, (("authorization", f"Basic {ALICE}"),))),
            code_of(await call(address, bearer_metadata(ALICE))),
            code_of(await call(address, bearer_metadata(BOB))),
            code_of(await call(address, (("authorization", f"bearer  {ROOT} "),))),
            await serving(address),
        ]

    unauthenticated = (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
    outcomes = serve(rules, scenario, keyring=KeyRing.parse(KEYS))
    assert outcomes == [
        unauthenticated,
        unauthenticated,
        unauthenticated,
        unauthenticated,
        (grpc.StatusCode.PERMISSION_DENIED, f"key {key_id(ALICE)} lacks scope admin or read"),
        "bob",
        "ops",
        True,
    ]


def test_each_call_sees_its_own_principal_in_concurrent_streams() -> None:
    async def scenario(address: str) -> list[list[str]]:
        async def stream(key: str) -> list[str]:
            async with grpc.aio.insecure_channel(address) as channel:
                call = wgrpc.DecodeWorkerStub(channel).Decode(
                    wpb.DecodeRequest(sampling=rpb.SamplingParams()),
                    metadata=bearer_metadata(key),
                    timeout=10,
                )
                return [m.request_id async for m in call]

        return list(await asyncio.gather(stream(ALICE), stream(BOB), stream(ALICE)))

    rules: dict[str, Rule] = {"tandem.v1.DecodeWorker": Bearer("generate")}
    outcomes = serve(rules, scenario, keyring=KeyRing.parse(KEYS), streams=3)
    assert outcomes == [["alice", "alice"], ["bob", "bob"], ["alice", "alice"]]


def test_without_credentials_configured_every_call_passes(secret_auth: AuthConfig) -> None:
    """Development mode: no secret and no keyring check nothing; principal None."""

    async def scenario(address: str) -> list[Any]:
        return [code_of(await call(address)), code_of(await call(address, bearer_metadata(ALICE)))]

    assert serve({"tandem.v1.DecodeWorker": Internal()}, scenario) == ["nobody", "nobody"]
    assert serve({"tandem.v1.DecodeWorker": Bearer("admin")}, scenario) == ["nobody", "nobody"]
    # An Open rule ignores the credentials that are configured.
    opened = serve({"tandem.v1.DecodeWorker": Open()}, scenario, auth=secret_auth)
    assert opened == ["nobody", "nobody"]


def test_auth_is_checked_before_the_request_is_judged(secret_auth: AuthConfig) -> None:
    """A request that does not decode, without credentials: UNAUTHENTICATED (the caller
    learns nothing about the method); with them: StatusInterceptor's INVALID_ARGUMENT."""

    async def scenario(address: str) -> list[Any]:
        outcomes = []
        for metadata in ((), (("x-tandem-cluster-key", cluster_key(SECRET)),)):
            async with grpc.aio.insecure_channel(address) as channel:
                method = channel.unary_unary("/tandem.v1.DecodeWorker/GetStats")
                try:
                    await method(b"\xff\xff\xff", metadata=metadata, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    outcomes.append(exc.code())
        return outcomes

    outcomes = serve({"tandem.v1.DecodeWorker": Internal()}, scenario, auth=secret_auth)
    assert outcomes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT]
