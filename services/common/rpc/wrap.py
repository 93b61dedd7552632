"""One way to put code around an async gRPC behaviour, for the three places that do: the
status interceptor (tandem's statuses for bad bytes and unexpected errors), the auth
interceptor (admit, then run) and the `rpc` decorator (a `ServiceError` ends the call). The
two interceptors are `HandlerInterceptor`s: each rewrites a known method's handler.

A behaviour is a coroutine function or an async generator function (a streaming response);
`around` returns one of the same kind, taking the same arguments (`(request, context)`, or
`(self, request, context)` for a servicer method):

    before(request, context) -> request      runs first, outside the handler's errors: may
                                             abort the call or hand on another request
    the behaviour                            its messages passed through one by one
    on_error(context, exc)                   for an exception of the `catch` types (never a
                                             grpc.aio.BaseError: an abort and gRPC's own
                                             signals pass through, as does cancellation)

A streaming behaviour's generator is closed when the call ends however it ends, so a
cancelled call runs the handler's cleanup at once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


class HandlerInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that rewrites the handler of each known method
    (`wrap_handler`); an unknown method keeps gRPC's own answer, UNIMPLEMENTED."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self.wrap_handler(handler, handler_call_details.method)

    def wrap_handler(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        raise NotImplementedError


Before = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
OnError = Callable[[grpc.aio.ServicerContext, Exception], Awaitable[Any]]


def handler_kind(handler: grpc.RpcMethodHandler) -> str:
    """The field of `handler` that holds its behaviour: "unary_unary", "unary_stream",
    "stream_unary" or "stream_stream"."""
    return ("stream" if handler.request_streaming else "unary") + (
        "_stream" if handler.response_streaming else "_unary"
    )


def is_async(behavior: Callable[..., Any]) -> bool:
    """A coroutine or async generator function: what `around` can wrap."""
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


def around(
    behavior: Callable[..., Any],
    *,
    before: Before | None = None,
    catch: tuple[type[Exception], ...] = (),
    on_error: OnError | None = None,
) -> Callable[..., Any]:
    """`behavior` with `before` run first and `on_error` called for a `catch` exception (see
    the module docstring). `behavior` must be async (`is_async`)."""
    if catch and on_error is None:
        raise ValueError("around: catch needs an on_error")

    if inspect.isasyncgenfunction(behavior):

        @functools.wraps(behavior)
        async def stream(*args: Any) -> AsyncIterator[Any]:
            *lead, request, context = args
            if before is not None:
                request = await before(request, context)
            messages = behavior(*lead, request, context)
            try:
                async for message in messages:
                    yield message
            except grpc.aio.BaseError:
                raise
            except catch as exc:
                assert on_error is not None
                await on_error(context, exc)
            finally:
                await messages.aclose()  # a cancelled call runs the handler's cleanup now

        return stream

    @functools.wraps(behavior)
    async def unary(*args: Any) -> Any:
        *lead, request, context = args
        if before is not None:
            request = await before(request, context)
        try:
            return await behavior(*lead, request, context)
        except grpc.aio.BaseError:
            raise
        except catch as exc:
            assert on_error is not None
            return await on_error(context, exc)

    return unary


def replace_behavior(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by `wrap(behaviour)`."""
    kind = handler_kind(handler)
    return handler._replace(**{kind: wrap(getattr(handler, kind))})
