"""services.common.errors: a ServiceError raised anywhere in a handler ends the call with
its status, for unary and streaming handlers alike, and the stream's cleanup runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common import errors
from services.common.errors import ServiceError, invalid_argument, rpc


class Aborted(Exception):
    pass


class Context:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.status = (code, message)
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
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, (grpc.StatusCode.INVALID_ARGUMENT, "bad")),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, (grpc.StatusCode.RESOURCE_EXHAUSTED, "bad")),
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
