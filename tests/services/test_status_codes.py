"""Requests that do not decode end with INVALID_ARGUMENT naming the message type and the
problem, never UNKNOWN with a Python class name, on every kind of method of a real router
and a real worker process (the check is in `start_grpc_server`, shared by all services);
an error a handler did not expect ends with INTERNAL, its class name only in the log."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2

from tandem.services.common.redis.server import RedisServer
from tandem.services.common.runtime.process import start_grpc_server
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb

NOT_PROTOBUF = b"\xff\xff\xff"
MARKER = "@@"  # a valid message carries it in a string field; the bytes replace it
INVALID_UTF8 = b"\xc3\x28"  # a 2-byte sequence lead followed by a non-continuation byte
PYTHON_NAMES = re.compile(r"<class|Error\b|Exception|Traceback|google\.protobuf")


def with_invalid_utf8(message: Message) -> bytes:
    raw = message.SerializeToString()
    assert raw.count(MARKER.encode()) == 1
    return raw.replace(MARKER.encode(), INVALID_UTF8)


@pytest.fixture(scope="module")
def services(
    procs: Any, tiny_model_dir: Path, redis_server: RedisServer
) -> Iterator[dict[str, str]]:
    """A router and a decode worker (no registration needed: the test dials both)."""
    router, router_address = procs.router(tiny_model_dir, redis_server.url)
    try:
        worker, worker_address = procs.worker(
            "decode", tiny_model_dir, redis_server.url, "status-d0", "--transport", "local"
        )
    except BaseException:
        procs.stop(router)
        raise
    try:
        yield {"router": router_address, "worker": worker_address}
    finally:
        procs.stop(router, worker)


def call(address: str, method: str, kind: str, raw: bytes) -> grpc.RpcError:
    """Send `raw` as the request of `method` (a unary_unary, unary_stream or stream_stream
    method); return the error the call ends with."""
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            if kind == "unary_unary":
                channel.unary_unary(method)(raw, timeout=30)
            elif kind == "unary_stream":
                list(channel.unary_stream(method)(raw, timeout=30))
            else:
                list(channel.stream_stream(method)(iter([raw]), timeout=30))
    return err.value


CASES = [
    # (service, method, kind, request bytes, type name, problem)
    (
        "router",
        "/tandem.v1.Router/Generate",
        "unary_stream",
        with_invalid_utf8(rpb.GenerateRequest(text=MARKER)),
        "tandem.v1.GenerateRequest",
        "invalid UTF-8 in a string field",
    ),
    (
        "router",
        "/tandem.v1.Router/Generate",
        "unary_stream",
        NOT_PROTOBUF,
        "tandem.v1.GenerateRequest",
        "the bytes are not a valid protobuf encoding",
    ),
    (
        "router",
        "/tandem.v1.Router/Tokenize",
        "unary_unary",
        with_invalid_utf8(rpb.TokenizeRequest(text=MARKER)),
        "tandem.v1.TokenizeRequest",
        "invalid UTF-8 in a string field",
    ),
    (
        "router",
        "/grpc.health.v1.Health/Check",
        "unary_unary",
        NOT_PROTOBUF,
        "grpc.health.v1.HealthCheckRequest",
        "the bytes are not a valid protobuf encoding",
    ),
    (
        "router",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "stream_stream",
        NOT_PROTOBUF,
        "grpc.reflection.v1alpha.ServerReflectionRequest",
        "the bytes are not a valid protobuf encoding",
    ),
    (
        "worker",
        "/tandem.v1.DecodeWorker/Decode",
        "unary_stream",
        with_invalid_utf8(wpb.DecodeRequest(request_id=MARKER, prompt_token_ids=[5, 6])),
        "tandem.v1.DecodeRequest",
        "invalid UTF-8 in a string field",
    ),
    (
        "worker",
        "/tandem.v1.DecodeWorker/GetStats",
        "unary_unary",
        NOT_PROTOBUF,
        "tandem.v1.GetStatsRequest",
        "the bytes are not a valid protobuf encoding",
    ),
]


@pytest.mark.parametrize(
    ("service", "method", "kind", "raw", "type_name", "problem"),
    CASES,
    ids=[f"{c[0]}-{c[1].rsplit('/', 1)[1]}-{c[5].split()[0]}" for c in CASES],
)
def test_undecodable_request_is_invalid_argument_naming_the_problem(
    services: dict[str, str],
    service: str,
    method: str,
    kind: str,
    raw: bytes,
    type_name: str,
    problem: str,
) -> None:
    err = call(services[service], method, kind, raw)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details() == f"request is not a valid {type_name}: {problem}"
    assert not PYTHON_NAMES.search(err.details())


def test_well_formed_requests_still_work(services: dict[str, str]) -> None:
    with grpc.insecure_channel(services["router"]) as channel:
        tokenize = channel.unary_unary(
            "/tandem.v1.Router/Tokenize",
            request_serializer=rpb.TokenizeRequest.SerializeToString,
            response_deserializer=rpb.TokenizeResponse.FromString,
        )
        assert list(tokenize(rpb.TokenizeRequest(text="hello"), timeout=30).token_ids)
    with grpc.insecure_channel(services["worker"]) as channel:
        stats = channel.unary_unary(
            "/tandem.v1.DecodeWorker/GetStats",
            request_serializer=wpb.GetStatsRequest.SerializeToString,
            response_deserializer=wpb.WorkerStats.FromString,
        )
        assert stats(wpb.GetStatsRequest(), timeout=30).worker_id == "status-d0"


async def fails(request: health_pb2.HealthCheckRequest, context: Any) -> Any:
    raise KeyError(request.service)


async def fails_streaming(
    request: health_pb2.HealthCheckRequest, context: Any
) -> AsyncIterator[health_pb2.HealthCheckResponse]:
    yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    raise KeyError(request.service)


def test_unexpected_handler_error_is_internal_without_its_class_name() -> None:
    def add_failing(server: grpc.aio.Server) -> None:
        def handler(make: Any, behavior: Any) -> Any:
            return make(
                behavior,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            )

        methods = {
            "Unary": handler(grpc.unary_unary_rpc_method_handler, fails),
            "Stream": handler(grpc.unary_stream_rpc_method_handler, fails_streaming),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Failing", methods),)
        )

    async def main() -> list[grpc.aio.AioRpcError]:
        server, port = await start_grpc_server(
            "127.0.0.1", 0, (), add_failing, health.aio.HealthServicer()
        )
        raw = health_pb2.HealthCheckRequest(service="secret").SerializeToString()
        errors = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await channel.unary_unary("/test.Failing/Unary")(raw)
                errors.append(unary.value)
                with pytest.raises(grpc.aio.AioRpcError) as stream:
                    async for _ in channel.unary_stream("/test.Failing/Stream")(raw):
                        pass
                errors.append(stream.value)
        finally:
            await server.stop(0)
        return errors

    unary, stream = asyncio.run(main())
    for err, method in ((unary, "Unary"), (stream, "Stream")):
        assert err.code() == grpc.StatusCode.INTERNAL
        assert err.details() == (
            f"internal error in /test.Failing/{method}; the server log has the details"
        )
