"""The server side: rules (Open, Internal, Bearer) and AuthInterceptor, which checks them."""

from __future__ import annotations

import contextvars
import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.services.common.rpc.wrap import (
    HandlerInterceptor,
    around,
    handler_kind,
    is_async,
    replace_behavior,
)
from tandem.services.common.security.config import (
    AUTHORIZATION_METADATA,
    CLUSTER_KEY_METADATA,
    AuthConfig,
    cluster_key,
    load_secret,
)
from tandem.services.common.security.keys import KeyRing, Principal

log = logging.getLogger("tandem.services.common.security")

# -- rules and the server interceptor ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    """Anyone may call."""


@dataclass(frozen=True, slots=True)
class Internal:
    """Only services of this deployment (cluster key or cluster-signed client certificate)."""


@dataclass(frozen=True, slots=True, init=False)
class Bearer:
    """An API key holding any one of `scopes`: Bearer("admin", "read")."""

    scopes: frozenset[str]

    def __init__(self, *scopes: str) -> None:
        if not scopes:
            raise ValueError("Bearer needs at least one scope")
        object.__setattr__(self, "scopes", frozenset(scopes))


Rule = Open | Internal | Bearer

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "tandem_principal", default=None
)


def current_principal() -> Principal | None:
    """The caller of the RPC being handled, as its Bearer rule found it; None for Open and
    Internal calls and in development mode. gRPC aio runs each RPC in a task of its own, so
    the value is the call's own (tasks the handler starts inherit it)."""
    return _principal.get()


Admit = Callable[[Any], Awaitable[Principal | None]]


class AuthInterceptor(HandlerInterceptor):
    """Checks each call against its method's rule before the handler runs.

    Args:
        method_rules: "/pkg.Service/Method" or "pkg.Service" (every method of it) -> rule;
            a method's own entry wins over its service's.
        auth: where the cluster secret and the internal TLS files are (Internal rules);
            None or empty: Internal lets every call through.
        keyring: the keys Bearer rules accept; None: Bearer lets every call through.
        default: the rule of a method the map does not name (fail closed: Internal).
    Raises:
        ValueError, OSError: the cluster secret file is unreadable or too short (at start,
            not at the first call).
    """

    def __init__(
        self,
        method_rules: Mapping[str, Rule],
        *,
        auth: AuthConfig | None = None,
        keyring: KeyRing | None = None,
        default: Rule = Internal(),
    ) -> None:
        self._rules = dict(method_rules)
        self._default = default
        self._keyring = keyring
        self._mtls = auth is not None and auth.internal_tls
        self._cluster_key: bytes | None = None
        if auth is not None and auth.cluster_secret_file:
            self._cluster_key = cluster_key(load_secret(auth.cluster_secret_file)).encode()

    def rule(self, method: str) -> Rule:
        """The rule of a full method name ("/tandem.v1.Admin/SetRatio")."""
        if method in self._rules:
            return self._rules[method]
        service = method.lstrip("/").rpartition("/")[0]
        return self._rules.get(service, self._default)

    def wrap_handler(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        rule = self.rule(method)
        if isinstance(rule, Open):
            return handler
        if isinstance(rule, Internal):
            if self._cluster_key is None and not self._mtls:
                return handler  # development mode
            return _guard(handler, method, lambda ctx: self._internal(ctx, method))
        if self._keyring is None:
            return handler  # development mode
        keyring = self._keyring
        return _guard(handler, method, lambda ctx: self._bearer(ctx, method, rule, keyring))

    async def _internal(self, context: grpc.aio.ServicerContext, method: str) -> None:
        if self._mtls and _has_client_certificate(context):
            return None
        value = _metadata_value(context, CLUSTER_KEY_METADATA)
        if (
            self._cluster_key is not None
            and value is not None
            and hmac.compare_digest(value.encode("utf-8", "surrogateescape"), self._cluster_key)
        ):
            return None
        log.warning("refused %s from %s: no valid cluster credentials", method, context.peer())
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{method} is internal: it needs the cluster key ({CLUSTER_KEY_METADATA}) or a "
            "client certificate of the cluster CA",
        )

    async def _bearer(
        self, context: grpc.aio.ServicerContext, method: str, rule: Bearer, keyring: KeyRing
    ) -> Principal:
        try:
            return check_bearer(keyring, _metadata_value(context, AUTHORIZATION_METADATA), rule)
        except Refused as refused:
            level = logging.WARNING if refused.principal is not None else logging.INFO
            log.log(level, "refused %s from %s: %s", method, context.peer(), refused.message)
            await context.abort(refused.code, refused.message)
            raise AssertionError("unreachable: context.abort raises") from None


class Refused(Exception):
    """A Bearer rule refused a call: the status and the message its caller gets.
    `principal`: the key's owner when the key was valid but lacked the scope."""

    def __init__(
        self, code: grpc.StatusCode, message: str, principal: Principal | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.principal = principal


def check_bearer(keyring: KeyRing, authorization: str | None, rule: Bearer) -> Principal:
    """The principal of an `authorization` value ("Bearer <key>") that `rule` admits: the
    one check of the gRPC interceptor and the HTTP API. Raises Refused (UNAUTHENTICATED: no
    or unknown key; PERMISSION_DENIED: a key without any of the rule's scopes)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    principal = keyring.lookup(token) if scheme.lower() == "bearer" and token else None
    if principal is None:
        raise Refused(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
    if not principal.scopes & rule.scopes:
        needed = " or ".join(sorted(rule.scopes))
        message = f"key {principal.key_id} lacks scope {needed}"
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, message, principal)
    return principal


def _metadata_value(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name and isinstance(value, str):
            return value
    return None


def _has_client_certificate(context: grpc.aio.ServicerContext) -> bool:
    """A TLS peer that presented a certificate. Servers using server_port_credentials
    require one and verify it against the cluster CA during the handshake."""
    auth_context = context.auth_context()
    return auth_context.get("transport_security_type") == [b"ssl"] and bool(
        auth_context.get("x509_pem_cert")
    )


def _guard(handler: grpc.RpcMethodHandler, method: str, admit: Admit) -> grpc.RpcMethodHandler:
    """`handler` whose behaviour first runs `admit` (which aborts the call or returns the
    principal the handler sees through current_principal())."""
    if is_async(getattr(handler, handler_kind(handler))):

        async def admitted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _principal.set(await admit(context))
            return request

        return replace_behavior(handler, lambda behavior: around(behavior, before=admitted))

    # A sync handler cannot await the check: refuse rather than let it through unchecked.
    log.error("%s has a sync handler; AuthInterceptor refuses its calls", method)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.INTERNAL, f"{method} cannot be authenticated (sync handler)"
        )

    return replace_behavior(handler, lambda _: refuse)
