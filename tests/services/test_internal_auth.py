"""The internal plane and the admin API with real processes: workers with a cluster secret or
mutual TLS (certificates made here with the openssl CLI) refuse calls without the cluster's
credentials and serve those with them; the decode worker confirms leases at the prefill
worker with them; the controller's admin API wants an admin key, which `tandem ctl` sends."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.cli.main import main as tandem_main
from tandem.services.common.rpc.healthcheck import check
from tandem.services.common.security import AuthConfig, bearer_metadata, internal_channel, key_id
from tandem.v1 import admin_pb2 as apb
from tandem.v1 import admin_pb2_grpc as agrpc
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.certs import make_ca, make_cert
from tests.services.workers import aprefill_result

SECRET = b"the-cluster-secret-of-this-test-0123"
ADMIN = "ops-admin-key-0123456789"
READER = "dashboard-read-key-0123456789"


# -- credentials -------------------------------------------------------------------------------


def tls_auth(d: Path, name: str, ca: str = "cluster-ca") -> AuthConfig:
    return AuthConfig(
        internal_tls_cert_file=str(d / f"{name}.pem"),
        internal_tls_key_file=str(d / f"{name}.key"),
        internal_ca_file=str(d / f"{ca}.pem"),
    )


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The cluster secret, a cluster CA with a worker's and a router's certificates, another
    CA with a rogue client's, and the controller's admin keys."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make certificates")
    d = tmp_path_factory.mktemp("creds")
    (d / "secret").write_bytes(SECRET + b"\n")
    make_ca(d, "cluster-ca")
    make_cert(d, "worker", "cluster-ca")
    make_cert(d, "router", "cluster-ca")
    make_ca(d, "other-ca")
    make_cert(d, "rogue", "other-ca")
    (d / "admin-keys").write_text(f"{ADMIN} ops admin\n{READER} dashboards read\n")
    (d / "admin-key").write_text(ADMIN + "\n")
    (d / "read-key").write_text(READER + "\n")
    return SimpleNamespace(dir=d, secret=AuthConfig(cluster_secret_file=str(d / "secret")))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def get_stats(channel: grpc.aio.Channel, **kw: Any) -> str | grpc.StatusCode:
    """GetStats' worker_id, or the status code of its failure."""
    try:
        stats = await wgrpc.DecodeWorkerStub(channel).GetStats(
            wpb.GetStatsRequest(), timeout=10, **kw
        )
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return str(stats.worker_id)


async def decode(channel: grpc.aio.Channel, request: wpb.DecodeRequest) -> Any:
    """(token ids, DecodeComplete), or the status code of the failure."""
    tokens: list[int] = []
    complete = None
    try:
        async for msg in wgrpc.DecodeWorkerStub(channel).Decode(request, timeout=60):
            if msg.WhichOneof("kind") == "chunk":
                tokens += msg.chunk.token_ids
            elif msg.WhichOneof("kind") == "complete":
                complete = msg.complete
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return tokens, complete


SAMPLING = rpb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


# -- workers with a cluster secret -------------------------------------------------------------


@pytest.fixture(scope="module")
def secret_workers(
    tiny_model_dir: Path, procs: SimpleNamespace, creds: SimpleNamespace
) -> Iterator[SimpleNamespace]:
    flags = ("--cluster-secret-file", str(creds.dir / "secret"))
    prefill, p_addr = procs.worker("prefill", tiny_model_dir, "", "auth-p0", *flags)
    try:
        decode, d_addr = procs.worker("decode", tiny_model_dir, "", "auth-d0", *flags)
    except BaseException:
        procs.stop(prefill)
        raise
    yield SimpleNamespace(prefill=p_addr, decode=d_addr)
    procs.stop(prefill, decode)


def test_worker_refuses_calls_without_the_cluster_key(
    secret_workers: SimpleNamespace, creds: SimpleNamespace
) -> None:
    async def scenario() -> list[Any]:
        request = wpb.DecodeRequest(request_id="r", prompt_token_ids=PROMPT, sampling=SAMPLING)
        async with grpc.aio.insecure_channel(secret_workers.decode) as plain:
            wrong = (("x-tandem-cluster-key", "0" * 64),)
            outcomes = [
                await get_stats(plain),
                await get_stats(plain, metadata=wrong),
                await decode(plain, request),
            ]
            health = await health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(service="tandem.v1.DecodeWorker"), timeout=10
            )
            outcomes.append(health.status == health_pb2.HealthCheckResponse.SERVING)
        async with internal_channel(secret_workers.decode, creds.secret) as keyed:
            outcomes.append(await get_stats(keyed))
            tokens, complete = await decode(keyed, request)
            outcomes.append((len(tokens), complete.finish_reason == rpb.FINISH_REASON_LENGTH))
        return outcomes

    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    outcomes = run(scenario())
    assert outcomes == [
        unauthenticated,
        unauthenticated,
        unauthenticated,
        True,
        "auth-d0",
        (8, True),
    ]
    # The kubelet-style probe (no metadata) still sees the worker.
    assert check(int(secret_workers.decode.rsplit(":", 1)[1])).serving


def test_decode_confirms_the_lease_at_the_prefill_worker_with_the_cluster_key(
    secret_workers: SimpleNamespace, creds: SimpleNamespace
) -> None:
    """The hand-off's ReleaseKv goes decode -> prefill over internal_channel: the KV read is
    used (not recomputed) and the prefill worker unpins the blocks."""

    async def scenario() -> tuple[Any, Any, Any, Any]:
        prompt = [(7 * i) % 200 + 5 for i in range(40)]
        async with internal_channel(secret_workers.prefill, creds.secret) as p_ch:
            prefill = wgrpc.PrefillWorkerStub(p_ch)
            first = await aprefill_result(
                prefill.Prefill(
                    wpb.PrefillRequest(request_id="h", prompt_token_ids=prompt, sampling=SAMPLING),
                    timeout=60,
                )
            )
            async with internal_channel(secret_workers.decode, creds.secret) as d_ch:
                request = wpb.DecodeRequest(
                    request_id="h",
                    prompt_token_ids=prompt,
                    output_token_ids=[first.first_token_id],
                    sampling=SAMPLING,
                    kv=first.kv,
                )
                handed_off = await decode(d_ch, request)
                alone = await decode(
                    d_ch,
                    wpb.DecodeRequest(request_id="a", prompt_token_ids=prompt, sampling=SAMPLING),
                )
            stats = await prefill.GetStats(wpb.GetStatsRequest(), timeout=10)
        return first, handed_off, alone, stats

    first, (tokens, complete), (alone, _), stats = run(scenario())
    assert not complete.recomputed and complete.kv_transfer_bytes > 0
    assert [first.first_token_id, *tokens] == alone
    assert stats.num_pinned_requests == 0


# -- a worker with mutual TLS --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_worker(
    tiny_model_dir: Path, procs: SimpleNamespace, creds: SimpleNamespace
) -> Iterator[str]:
    auth = tls_auth(creds.dir, "worker")
    proc, address = procs.worker(
        "decode", tiny_model_dir, "", "auth-tls-d0", "--transport", "local",
        "--internal-tls-cert-file", auth.internal_tls_cert_file,
        "--internal-tls-key-file", auth.internal_tls_key_file,
        "--internal-ca-file", auth.internal_ca_file,
    )  # fmt: skip
    yield address
    procs.stop(proc)


def test_tls_worker_serves_only_clients_with_a_cluster_certificate(
    tls_worker: str, creds: SimpleNamespace
) -> None:
    d = creds.dir
    ca = (d / "cluster-ca.pem").read_bytes()

    async def scenario() -> list[Any]:
        outcomes: list[Any] = []
        async with internal_channel(tls_worker, tls_auth(d, "router")) as good:
            outcomes.append(await get_stats(good))
            health = await health_pb2_grpc.HealthStub(good).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            outcomes.append(health.status == health_pb2.HealthCheckResponse.SERVING)
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        rogue = grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=(d / "rogue.key").read_bytes(),
            certificate_chain=(d / "rogue.pem").read_bytes(),
        )
        for credentials in (no_cert, rogue):
            async with grpc.aio.secure_channel(tls_worker, credentials) as channel:
                outcomes.append(await get_stats(channel))
        async with grpc.aio.insecure_channel(tls_worker) as plain:
            outcomes.append(await get_stats(plain))
        return outcomes

    unavailable = grpc.StatusCode.UNAVAILABLE  # the handshake fails: no call reaches it
    assert run(scenario()) == ["auth-tls-d0", True, unavailable, unavailable, unavailable]


# -- the controller's admin API ----------------------------------------------------------------


@pytest.fixture(scope="module")
def controller(procs: SimpleNamespace, creds: SimpleNamespace) -> Iterator[str]:
    proc, address = procs.spawn(
        "tandem.services.controller", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--admin-keys-file", str(creds.dir / "admin-keys"),
    )  # fmt: skip
    yield address
    procs.stop(proc)


def test_admin_api_needs_an_admin_key_to_change_and_a_read_key_to_watch(controller: str) -> None:
    async def scenario() -> list[Any]:
        outcomes: list[Any] = []
        async with grpc.aio.insecure_channel(controller) as channel:
            stub = agrpc.AdminStub(channel)
            calls = [
                ("status", (), lambda md: stub.Status(apb.StatusRequest(), metadata=md)),
                ("status", bearer_metadata("not-a-key-0123456789"),
                 lambda md: stub.Status(apb.StatusRequest(), metadata=md)),
                ("status", bearer_metadata(READER),
                 lambda md: stub.Status(apb.StatusRequest(), metadata=md)),
                ("explain", bearer_metadata(READER),
                 lambda md: stub.Explain(apb.ExplainRequest(), metadata=md)),
                ("set-ratio", (), lambda md: stub.SetRatio(
                    apb.SetRatioRequest(prefill=1, decode=1), metadata=md)),
                ("set-ratio", bearer_metadata(READER), lambda md: stub.SetRatio(
                    apb.SetRatioRequest(prefill=1, decode=1), metadata=md)),
                ("set-ratio", bearer_metadata(ADMIN), lambda md: stub.SetRatio(
                    apb.SetRatioRequest(prefill=1, decode=1), metadata=md)),
                ("auto", bearer_metadata(READER), lambda md: stub.Auto(
                    apb.AutoRequest(), metadata=md)),
                ("auto", bearer_metadata(ADMIN), lambda md: stub.Auto(
                    apb.AutoRequest(), metadata=md)),
            ]  # fmt: skip
            for name, metadata, send in calls:
                try:
                    resp = await send(metadata)
                except grpc.aio.AioRpcError as exc:
                    outcomes.append((name, exc.code(), exc.details()))
                else:
                    outcomes.append((name, getattr(resp, "mode", "ok")))
        return outcomes

    no_key = grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key"
    lacks_admin = grpc.StatusCode.PERMISSION_DENIED, f"key {key_id(READER)} lacks scope admin"
    assert run(scenario()) == [
        ("status", *no_key),
        ("status", *no_key),
        ("status", "auto"),
        ("explain", "ok"),
        ("set-ratio", *no_key),
        ("set-ratio", *lacks_admin),
        ("set-ratio", "manual"),
        ("auto", *lacks_admin),
        ("auto", "auto"),
    ]


def test_ctl_sends_the_admin_key_from_a_file_or_the_environment(
    controller: str,
    creds: SimpleNamespace,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TANDEM_ADMIN_KEY", raising=False)
    ctl = ["ctl", "--address", controller, "--timeout", "10"]
    assert tandem_main([*ctl, "status"]) == 2
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "--admin-key-file" in err and "TANDEM_ADMIN_KEY" in err

    key_file = str(creds.dir / "admin-key")
    assert tandem_main([*ctl, "--admin-key-file", key_file, "status"]) == 0
    assert "mode: auto" in capsys.readouterr().out
    assert tandem_main([*ctl, "--admin-key-file", key_file, "set-ratio", "1", "1"]) == 0
    assert "mode: manual" in capsys.readouterr().out

    read_file = str(creds.dir / "read-key")
    assert tandem_main([*ctl, "--admin-key-file", read_file, "auto"]) == 2
    err = capsys.readouterr().err
    assert f"PERMISSION_DENIED: key {key_id(READER)} lacks scope admin" in err
    assert READER not in err

    monkeypatch.setenv("TANDEM_ADMIN_KEY", ADMIN)
    assert tandem_main([*ctl, "auto"]) == 0
    assert "mode: auto" in capsys.readouterr().out
