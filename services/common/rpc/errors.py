"""One error type at the service edge, mapped to a gRPC status in one place.

Handlers raise `ServiceError` (usually through a helper: `invalid_argument(...)`) wherever
they find a problem; the `@rpc` decorator on each servicer method ends the call with that
status and message. Messages name the field and the values so a user can act on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc

# The pushback trailer (milliseconds to wait before a retry) and its reader live in the
# client, which must not import services.
from tandem.client import RETRY_AFTER_KEY as RETRY_AFTER_KEY
from tandem.client import retry_after as retry_after
from tandem.services.common.rpc.wrap import around

F = TypeVar("F", bound=Callable[..., Any])


class ServiceError(Exception):
    """A request ends with gRPC status `code` and `message`; `retry_after_s`, when set, is
    sent as the `tandem-retry-after-ms` trailer (and in the router's in-stream Error)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retry_after_ms(self) -> int:
        return 0 if self.retry_after_s is None else max(1, round(self.retry_after_s * 1e3))


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unavailable(message: str, retry_after_s: float | None = None) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, retry_after_s)


def resource_exhausted(message: str, retry_after_s: float | None = None) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s)


def already_exists(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.ALREADY_EXISTS, message)


def aborted(request_id: str) -> ServiceError:
    """The request was aborted (its call, or one that overtook it, asked for that)."""
    return ServiceError(grpc.StatusCode.ABORTED, f"request_id {request_id!r} was aborted")


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def failed_precondition(message: str) -> ServiceError:
    """The deployment cannot serve the request as configured (e.g. prefill and decode
    workers disagree about the KV cache layout); retrying does not help."""
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def from_worker(exc: grpc.aio.AioRpcError) -> ServiceError:
    """What a client should see when a worker call failed: the worker's verdict on the
    request itself, or on the deployment (FAILED_PRECONDITION: misconfigured workers, which
    a retry would meet again; PERMISSION_DENIED: a KV hand-off whose signature or owner the
    decode worker refused, forged or signed with another cluster secret, which no retry
    fixes either), passes through; UNAUTHENTICATED (the worker refused our cluster
    credentials) is a misconfiguration too (FAILED_PRECONDITION); anything else is the
    worker's failure, retryable."""
    code = exc.code()
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
    ):
        return ServiceError(code, exc.details() or code.name, retry_after(exc))
    if code is grpc.StatusCode.UNAUTHENTICATED:
        # The worker refused this service's internal credentials: a deployment whose
        # processes disagree on the cluster secret or CA. Retrying meets the same answer.
        return failed_precondition(
            "a worker refused the router's cluster credentials (cluster_secret_file or the "
            "internal CA differ between router and workers)"
        )
    return unavailable(f"worker failed ({code.name}: {exc.details()}); retry", retry_after(exc))


async def abort(context: grpc.aio.ServicerContext, error: ServiceError) -> NoReturn:
    """End the RPC with `error` (context.abort raises; this tells the type checker so)."""
    trailers = ((RETRY_AFTER_KEY, str(error.retry_after_ms)),) if error.retry_after_ms else ()
    await context.abort(error.code, error.message, trailers)
    raise AssertionError("unreachable: context.abort raises")


def rpc(method: F) -> F:
    """Servicer method decorator: a `ServiceError` raised inside ends the call with its
    status. Works for unary handlers and for streaming (async generator) handlers."""
    return around(method, catch=(ServiceError,), on_error=_abort_with)  # type: ignore[return-value]


async def _abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    assert isinstance(exc, ServiceError)
    await abort(context, exc)
