"""tandem.services.common.rpc.errors: a ServiceError raised anywhere in a handler ends the call with
its status, for unary and streaming handlers alike, and the stream's cleanup runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from tandem.services.common.rpc import errors
from tandem.services.common.rpc.errors import ServiceError, invalid_argument, rpc


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.trailers: tuple[tuple[str, str], ...] = ()

    async def abort(
        self, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.status = (code, message)
        self.trailers = trailers
        raise Aborted


class Servicer:
    def __init__(self) -> None:
        self.cleaned_up = False

    @rpc
    async def Unary(self, request: int, context: Context) -> int:
        if request < 0:
            raise invalid_argument(f"n: must be >= 0, got {request}")
        return request * 2

    @rpc
    async def Stream(self, request: int, context: Context) -> AsyncIterator[int]:
        try:
            yield 1
            if request < 0:
                raise errors.resource_exhausted("no room")
            yield 2
        finally:
            self.cleaned_up = True


def test_unary_success_and_mapped_error() -> None:
    s, ctx = Servicer(), Context()
    assert asyncio.run(s.Unary(4, ctx)) == 8 and ctx.status is None
    with pytest.raises(Aborted):
        asyncio.run(s.Unary(-1, ctx))
    assert ctx.status == (grpc.StatusCode.INVALID_ARGUMENT, "n: must be >= 0, got -1")


def test_stream_error_after_messages_ends_with_its_status() -> None:
    s, ctx = Servicer(), Context()

    async def drain(n: int) -> list[int]:
        return [m async for m in s.Stream(n, ctx)]

    assert asyncio.run(drain(1)) == [1, 2]
    got: list[int] = []

    async def partial() -> None:
        async for m in s.Stream(-1, ctx):
            got.append(m)

    with pytest.raises(Aborted):
        asyncio.run(partial())
    assert got == [1] and ctx.status == (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
    assert s.cleaned_up


def test_closing_the_stream_early_runs_the_handler_cleanup_at_once() -> None:
    s, ctx = Servicer(), Context()

    async def first_only() -> None:
        stream = s.Stream(1, ctx)
        assert await anext(stream) == 1
        await stream.aclose()  # what a cancelled call does
        assert s.cleaned_up

    asyncio.run(first_only())


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, (grpc.StatusCode.INVALID_ARGUMENT, "bad")),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, (grpc.StatusCode.RESOURCE_EXHAUSTED, "bad")),
        (grpc.StatusCode.ALREADY_EXISTS, (grpc.StatusCode.ALREADY_EXISTS, "bad")),
        (grpc.StatusCode.FAILED_PRECONDITION, (grpc.StatusCode.FAILED_PRECONDITION, "bad")),
        (grpc.StatusCode.DEADLINE_EXCEEDED, (grpc.StatusCode.DEADLINE_EXCEEDED, "bad")),
        (
            grpc.StatusCode.INTERNAL,
            (grpc.StatusCode.UNAVAILABLE, "worker failed (INTERNAL: bad); retry"),
        ),
    ],
)
def test_worker_failures_map_to_what_the_client_can_act_on(
    code: grpc.StatusCode, expected: tuple[grpc.StatusCode, str]
) -> None:
    err: ServiceError = errors.from_worker(FakeRpcError(code, "bad"))
    assert (err.code, err.message) == expected


def test_abort_sends_the_retry_after_trailer_only_with_a_hint() -> None:
    ctx = Context()
    with pytest.raises(Aborted):
        asyncio.run(errors.abort(ctx, errors.resource_exhausted("full", retry_after_s=0.25)))
    assert ctx.status == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert ctx.trailers == ((errors.RETRY_AFTER_KEY, "250"),)
    with pytest.raises(Aborted):
        asyncio.run(errors.abort(ctx, errors.already_exists("request_id: 'r' is running")))
    assert ctx.trailers == ()


def test_retry_after_ms_rounds_and_is_at_least_one_when_set() -> None:
    assert errors.unavailable("x").retry_after_ms == 0
    assert errors.unavailable("x", retry_after_s=0.0001).retry_after_ms == 1
    assert errors.unavailable("x", retry_after_s=1.2344).retry_after_ms == 1234


@pytest.mark.parametrize(
    ("trailers", "expected"),
    [
        (((errors.RETRY_AFTER_KEY, "250"),), 0.25),
        ((("other", "1"), (errors.RETRY_AFTER_KEY, "0")), 0.0),
        (((errors.RETRY_AFTER_KEY, "-5"),), 0.0),
        (((errors.RETRY_AFTER_KEY, "soon"),), None),
        ((), None),
    ],
)
def test_retry_after_reads_the_trailer(
    trailers: tuple[tuple[str, str], ...], expected: float | None
) -> None:
    assert errors.retry_after(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "x", trailers)) == expected


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS),
        (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_from_worker_keeps_the_workers_hint(
    code: grpc.StatusCode, expected: grpc.StatusCode
) -> None:
    exc = FakeRpcError(code, "bad", ((errors.RETRY_AFTER_KEY, "1500"),))
    err = errors.from_worker(exc)
    assert (err.code, err.retry_after_s) == (expected, 1.5)
    assert errors.from_worker(FakeRpcError(code, "bad")).retry_after_s is None


class HintingServicer:
    """Ends every call with the ServiceError it is given, through @rpc, as a worker does."""

    def __init__(self, error: ServiceError) -> None:
        self.error = error

    @rpc
    async def Unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise self.error

    @rpc
    async def Stream(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"first"
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        errors.resource_exhausted("worker full", retry_after_s=0.75),
        errors.unavailable("draining", retry_after_s=2.0),
        errors.already_exists("request_id: 'r' is already running"),
    ],
)
def test_status_and_hint_round_trip_over_grpc(error: ServiceError) -> None:
    """abort -> real gRPC -> retry_after / from_worker: what the router reads back is what the
    worker sent, for unary and streaming calls."""

    async def main() -> list[grpc.aio.AioRpcError]:
        servicer = HintingServicer(error)
        server = grpc.aio.server()
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(servicer.Unary),
            "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Hinting", handlers),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        failures = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await channel.unary_unary("/test.Hinting/Unary")(b"")
                failures.append(unary.value)
                got: list[bytes] = []
                with pytest.raises(grpc.aio.AioRpcError) as stream:
                    async for message in channel.unary_stream("/test.Hinting/Stream")(b""):
                        got.append(message)
                assert got == [b"first"]
                failures.append(stream.value)
        finally:
            await server.stop(0)
        return failures

    for exc in asyncio.run(main()):
        assert (exc.code(), exc.details()) == (error.code, error.message)
        assert errors.retry_after(exc) == error.retry_after_s
        passed = errors.from_worker(exc)  # UNAVAILABLE's message gains "worker failed"
        assert (passed.code, passed.retry_after_s) == (error.code, error.retry_after_s)


def test_a_worker_refusing_our_cluster_credentials_is_a_deployment_problem() -> None:
    class Refused(grpc.aio.AioRpcError):
        def __init__(self) -> None:
            pass

        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAUTHENTICATED

        def details(self) -> str:
            return "needs the cluster key"

        def trailing_metadata(self):  # type: ignore[no-untyped-def]
            return ()

    error = errors.from_worker(Refused())
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "cluster_secret_file" in error.message
