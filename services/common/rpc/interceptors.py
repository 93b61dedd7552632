"""A server interceptor that ends every call with a status a client can act on.

Without it gRPC ends two kinds of failure with UNKNOWN and a message naming a Python class:
a request whose bytes do not decode (not protobuf, or invalid UTF-8 in a string field: the
request deserializer raises before any handler runs) and an exception a handler did not
expect ("Unexpected <class 'KeyError'>: ..."). With it they end with

    INVALID_ARGUMENT  "request is not a valid tandem.v1.GenerateRequest: invalid UTF-8 in a
                       string field"
    INTERNAL          "internal error in /tandem.v1.Router/Generate; the server log has the
                       details" (the traceback goes to the log, not to the client)

The deserializer cannot end the call (it has no context), so a request that does not decode
becomes a `Malformed` value and the wrapped handler aborts the call when it receives one.
Only async handlers (coroutines, async generators: what every service here has) are wrapped;
a sync handler keeps gRPC's own behaviour. A stream-request handler sees the check when it
iterates its request iterator (not when it calls `context.read()` itself).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from tandem.services.common.rpc.wrap import (
    HandlerInterceptor,
    around,
    handler_kind,
    is_async,
    replace_behavior,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Malformed:
    """What the wrapped deserializer returns for bytes that do not decode."""

    message: str


class StatusInterceptor(HandlerInterceptor):
    """Wraps each method handler: see the module docstring."""

    def wrap_handler(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return guard(handler, method)


def guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that does not raise and a behaviour that ends the call
    with INVALID_ARGUMENT (request that did not decode) or INTERNAL (unexpected error)."""
    behavior = getattr(handler, handler_kind(handler))
    if not is_async(behavior):
        return handler
    streaming = handler.request_streaming

    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if streaming:
            return _checked(request, context)
        await _reject(request, context)
        return request

    async def internal(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
        await _internal(context, method, exc)

    guarded = replace_behavior(
        handler, lambda b: around(b, before=check, catch=(Exception,), on_error=internal)
    )
    deserializer = handler.request_deserializer
    if deserializer is None:
        return guarded
    return guarded._replace(request_deserializer=_decoder(deserializer, method))


def _decoder(deserializer: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    type_name = _request_type_name(deserializer, method)

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # the only input is the client's bytes: their fault
            return Malformed(f"request is not a valid {type_name}: {_reason(exc)}")

    return decode


def _request_type_name(deserializer: Callable[[bytes], Any], method: str) -> str:
    """'tandem.v1.GenerateRequest' for a generated `GenerateRequest.FromString`."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", None)
    return name if isinstance(name, str) else f"request message of {method}"


def _reason(exc: Exception) -> str:
    # upb says "String field had bad UTF-8"; the pure-Python protobuf raises
    # UnicodeDecodeError. Neither the exception's class nor its text goes to the client.
    if isinstance(exc, UnicodeDecodeError) or "utf-8" in str(exc).lower():
        return "invalid UTF-8 in a string field"
    return "the bytes are not a valid protobuf encoding"


async def _reject(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async for request in requests:
        await _reject(request, context)
        yield request


async def _internal(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> NoReturn:
    log.error("unexpected error in %s", method, exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error in {method}; the server log has the details"
    )
    raise AssertionError("unreachable: context.abort raises")
