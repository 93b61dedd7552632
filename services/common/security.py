"""Who may call what: the settings every service shares, the keys it loads, and the gRPC
pieces that check them (server) and present them (client).

Three planes (README "Security"):
  public    clients -> router: API keys (`authorization: Bearer <key>`), each naming a
            tenant and its scopes; optional server TLS.
  internal  router <-> workers <-> controller: a cluster secret (metadata, constant-time
            compared) or mutual TLS with a cluster CA; the same secret keys the HMAC of KV
            hand-offs (tandem.transfer.signing).
  admin     `tandem ctl` -> controller: admin keys.

Public API:
  AuthConfig                    the internal plane's files (nested as `auth` in each config)
  load_secret(path), derive_key(secret, purpose)
  Principal                     who called: key_id (a non-secret fingerprint), tenant, scopes
  KeyRing.load(path) / .parse(text)   `<key> <tenant> [scope,scope]` lines; .lookup(token)
  current_principal()           the Principal of the call being handled (None: no key used)
  Open(), Internal(), Bearer(*scopes)  rules, keyed by "/pkg.Service/Method" or "pkg.Service"
  AuthInterceptor(rules, auth=, keyring=, default=Internal())   server interceptor
  internal_channel(address, auth, options)   aio channel presenting this service's credentials
  internal_metadata(auth), bearer_metadata(key)   the same as per-call metadata
  server_port_credentials(auth) mTLS credentials for add_secure_port (None: TLS off)

Rules, checked before the handler runs (and before StatusInterceptor's checks):
  Open          anyone (gRPC health: the kubelet's probe sends no metadata; reflection).
  Internal      a service of this deployment: metadata `x-tandem-cluster-key` equal to
                derive_key(secret, "internal-auth").hex(), or, with internal TLS on, a client
                certificate the cluster CA signed (the handshake verifies it). Otherwise
                UNAUTHENTICATED.
  Bearer(s...)  `authorization: Bearer <key>` of a KeyRing key holding any one of the scopes:
                UNAUTHENTICATED "missing or invalid API key" without a known key,
                PERMISSION_DENIED "key <key_id> lacks scope <s>" without the scope. The
                handler reads the caller with current_principal().

Development mode: a rule whose credentials are not configured lets every call through.
Internal with no cluster_secret_file and no internal TLS, and Bearer with no KeyRing, check
nothing (current_principal() is None). That is `tandem up` on loopback without its key
flag; a deployment sets the files (the chart generates them).

Keys never reach a log or a status message: logs name a key by its key_id (first 8 hex
digits of its SHA-256).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

CLUSTER_KEY_METADATA = "x-tandem-cluster-key"
AUTHORIZATION_METADATA = "authorization"
DEFAULT_SCOPE = "generate"
MIN_SECRET_BYTES = 16
MIN_KEY_CHARS = 16


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """The internal plane's credentials (the same in every service of a deployment).

    Attributes:
        cluster_secret_file: a file holding the cluster secret (any bytes, >= 16; trailing
            whitespace ignored). Internal calls carry it in metadata and servers refuse calls
            without it; it also keys the HMAC of KV hand-offs. Empty: internal auth off.
        internal_tls_cert_file, internal_tls_key_file: this service's certificate and key
            for mutual TLS on the internal plane (server and client side).
        internal_ca_file: the cluster CA that signed every service's certificate.
    """

    cluster_secret_file: str = ""
    internal_tls_cert_file: str = ""
    internal_tls_key_file: str = ""
    internal_ca_file: str = ""

    def __post_init__(self) -> None:
        tls = (self.internal_tls_cert_file, self.internal_tls_key_file, self.internal_ca_file)
        if any(tls) and not all(tls):
            raise ValueError(
                "internal TLS needs internal_tls_cert_file, internal_tls_key_file and "
                "internal_ca_file together"
            )

    @property
    def internal_tls(self) -> bool:
        return bool(self.internal_ca_file)


def load_secret(path: str | Path) -> bytes:
    """The secret in `path`. Raises ValueError when it is shorter than 16 bytes."""
    secret = Path(path).read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret in {path} has {len(secret)} bytes; need >= {MIN_SECRET_BYTES}")
    return secret


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose ("kv-handoff", "internal-auth") from the cluster secret, so
    one leaked derived key does not reveal the others."""
    return hmac.new(secret, f"tandem/{purpose}/v1".encode(), hashlib.sha256).digest()


def cluster_key(secret: bytes) -> str:
    """What internal calls carry in `x-tandem-cluster-key`: the secret itself never travels."""
    return derive_key(secret, "internal-auth").hex()


# -- API keys ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller a key names. key_id: a short non-secret fingerprint of the key, for logs."""

    key_id: str
    tenant: str
    scopes: frozenset[str]


def key_id(key: str) -> str:
    """The first 8 hex digits of the key's SHA-256: names a key in logs without revealing it."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


class KeyRing:
    """API keys, each naming a tenant and its scopes. The file format, one key a line
    (`#` starts a comment, so keys hold no `#`):

        # comment
        <key> <tenant> [scope1,scope2]      (default scope: "generate")

    Keys are >= 16 printable ASCII characters without spaces; tenants and scopes are names
    of letters, digits and `._:-` (they appear in logs and cache salts)."""

    def __init__(self, entries: Iterable[tuple[str, str, Iterable[str]]] = ()) -> None:
        """entries: (key, tenant, scopes). Raises ValueError (naming the entry's position,
        never the key) for a short or malformed key, a bad name, or a duplicate key."""
        # sha256(key) -> (key, principal, where): the dict finds the candidate and
        # compare_digest confirms it, so no time depends on how much of a guess is right.
        self._by_digest: dict[bytes, tuple[bytes, Principal, str]] = {}
        for n, (key, tenant, scopes) in enumerate(entries, start=1):
            self._add(f"entry {n}", key, tenant, frozenset(scopes))

    def _add(self, where: str, key: str, tenant: str, scopes: frozenset[str]) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"{where}: key has {len(key)} characters; need >= {MIN_KEY_CHARS}")
        if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
            raise ValueError(f"{where}: key must be printable ASCII without spaces")
        if not _NAME.fullmatch(tenant):
            # The value is not quoted: a line with its fields swapped holds the key here.
            raise ValueError(f"{where}: tenant must be 1-64 of [A-Za-z0-9._:-]")
        if not scopes:
            raise ValueError(f"{where}: no scopes")
        for scope in sorted(scopes):
            if not _NAME.fullmatch(scope):
                raise ValueError(f"{where}: scopes must be 1-64 of [A-Za-z0-9._:-] each")
        raw = key.encode()
        digest = hashlib.sha256(raw).digest()
        if digest in self._by_digest:
            raise ValueError(f"{where}: duplicate key (also {self._by_digest[digest][2]})")
        self._by_digest[digest] = (raw, Principal(key_id(key), tenant, scopes), where)

    @classmethod
    def parse(cls, text: str, source: str = "<keys>") -> KeyRing:
        """A KeyRing from the file format above. Raises ValueError "<source> line N: ..."
        (never quoting a key), also when there is no key at all."""
        ring = cls()
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            where = f"{source} line {number}"
            if len(fields) not in (2, 3):
                raise ValueError(
                    f"{where}: need `<key> <tenant> [scope,scope]`, got {len(fields)} fields"
                )
            scopes = fields[2].split(",") if len(fields) == 3 else [DEFAULT_SCOPE]
            ring._add(where, fields[0], fields[1], frozenset(scopes))
        if not ring:
            raise ValueError(f"{source}: no keys")
        return ring

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """A KeyRing from a file (e.g. a mounted Kubernetes Secret)."""
        return cls.parse(Path(path).read_text(encoding="utf-8"), source=str(path))

    def lookup(self, token: str) -> Principal | None:
        """The principal of `token`, or None when it is no key of this ring."""
        raw = token.encode("utf-8", "surrogateescape")
        entry = self._by_digest.get(hashlib.sha256(raw).digest())
        if entry is None or not hmac.compare_digest(entry[0], raw):
            return None
        return entry[1]

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        return f"KeyRing({len(self)} keys)"  # never the keys


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


class AuthInterceptor(grpc.aio.ServerInterceptor):
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

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return None
        method = handler_call_details.method
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
    kind = ("stream" if handler.request_streaming else "unary") + (
        "_stream" if handler.response_streaming else "_unary"
    )
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _principal.set(await admit(context))
            messages = behavior(request, context)
            try:
                async for message in messages:
                    yield message
            finally:
                await messages.aclose()  # a cancelled call runs the handler's cleanup now

        return handler._replace(**{kind: stream})

    if inspect.iscoroutinefunction(behavior):

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            _principal.set(await admit(context))
            return await behavior(request, context)

        return handler._replace(**{kind: unary})

    # A sync handler cannot await the check: refuse rather than let it through unchecked.
    log.error("%s has a sync handler; AuthInterceptor refuses its calls", method)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.INTERNAL, f"{method} cannot be authenticated (sync handler)"
        )

    return handler._replace(**{kind: refuse})


# -- client side -------------------------------------------------------------------------------


def internal_metadata(auth: AuthConfig) -> tuple[tuple[str, str], ...]:
    """Metadata that authenticates an internal call: the cluster key, or () when no cluster
    secret is configured. For callers that pass metadata per call (sync channels)."""
    if not auth.cluster_secret_file:
        return ()
    return ((CLUSTER_KEY_METADATA, cluster_key(load_secret(auth.cluster_secret_file))),)


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """Metadata presenting an API or admin key."""
    return ((AUTHORIZATION_METADATA, f"Bearer {key}"),)


class _AddMetadata:
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def _details(self, details: Any) -> Any:
        merged = grpc.aio.Metadata(*tuple(details.metadata or ()), *self._metadata)
        return details._replace(metadata=merged)


class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def metadata_interceptors(metadata: Sequence[tuple[str, str]]) -> list[Any]:
    """aio client interceptors adding `metadata` to every call of a channel (one per call
    kind: grpc.aio files each interceptor under the first kind it implements)."""
    return [cls(metadata) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def channel_credentials(auth: AuthConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the cluster CA and presenting this service's certificate;
    None when internal TLS is off."""
    if not auth.internal_tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(auth.internal_ca_file).read_bytes(),
        private_key=Path(auth.internal_tls_key_file).read_bytes(),
        certificate_chain=Path(auth.internal_tls_cert_file).read_bytes(),
    )


def internal_channel(
    address: str, auth: AuthConfig, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An aio channel to another service of the deployment: TLS with the cluster CA and this
    service's certificate when internal TLS is set (the peer's certificate must name the
    host of `address`, e.g. a SAN with the pod IP or service DNS name; the option
    ("grpc.ssl_target_name_override", name) checks another name), plaintext otherwise; every
    call carries the cluster key when a cluster secret is set. gRPC sends call credentials
    only over TLS, so the key is added by a client interceptor, which works on both."""
    interceptors = (
        metadata_interceptors(internal_metadata(auth)) if auth.cluster_secret_file else None
    )
    credentials = channel_credentials(auth)
    if credentials is not None:
        return grpc.aio.secure_channel(
            address, credentials, options=list(options), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


def server_port_credentials(auth: AuthConfig) -> grpc.ServerCredentials | None:
    """Credentials for `server.add_secure_port`: this service's certificate, and client
    certificates required and verified against the cluster CA (mutual TLS). None when
    internal TLS is off (an insecure port)."""
    if not auth.internal_tls:
        return None
    return grpc.ssl_server_credentials(
        [
            (
                Path(auth.internal_tls_key_file).read_bytes(),
                Path(auth.internal_tls_cert_file).read_bytes(),
            )
        ],
        root_certificates=Path(auth.internal_ca_file).read_bytes(),
        require_client_auth=True,
    )
