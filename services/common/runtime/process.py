"""Process plumbing shared by the services: logging and native library settings, signals,
run-until-stop, gRPC server, and the keepalive options of channels between services."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from datetime import UTC, datetime
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.services.common.rpc.interceptors import StatusInterceptor
from tandem.services.common.runtime.supervised import die_with_supervisor
from tandem.services.common.security import AuthConfig, AuthInterceptor, KeyRing, Open, Rule

# Server options every service gets (a caller's `options` entry of the same name wins):
# accept the keepalive pings of clients using `channel_options` (one per second, also between
# calls) instead of answering them with GOAWAY "too_many_pings" and closing the connection.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 100),
    ("grpc.http2.max_ping_strikes", 0),  # 0: no limit on pings closer than the above
)


def channel_options(keepalive_s: float = 1.0) -> list[tuple[str, int]]:
    """Client channel options that find a dead or frozen (SIGSTOPped) peer: a keepalive ping
    every `keepalive_s`, also while idle, and the connection closed (its calls fail with
    UNAVAILABLE) when a ping is not acknowledged within `keepalive_s`; so about
    2 * `keepalive_s` after the peer stopped. Servers started by `start_grpc_server` accept
    pings this often.

    Raises ValueError unless keepalive_s > 0."""
    if not keepalive_s > 0:
        raise ValueError(f"keepalive_s must be > 0, got {keepalive_s}")
    interval_ms = max(1, round(keepalive_s * 1e3))
    return [
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", interval_ms),
        # How long any ping may go unacknowledged (internal to chttp2, default 1 minute).
        # grpcio 1.85 bounds a ping sent during a call by this, not by keepalive_timeout_ms.
        ("grpc.http2.ping_timeout_ms", interval_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # 0: ping even when no data was sent
        # Subchannels of its own: gRPC otherwise shares them between channels to the same
        # address, so a fresh channel (for a worker back from an outage) would inherit the
        # old connection's reconnect backoff.
        ("grpc.use_local_subchannel_pool", 1),
    ]


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has stopped (its cancellation is not an
    error of the caller's)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def setup_logging(name: str, log_format: str | None = None) -> None:
    """Log to stderr as service `name`, one line per record whatever the record holds, so
    client strings in it (request ids, model names, chat roles) can neither forge log lines
    nor drive a terminal.

    `log_format`: "text" (`time name LEVEL logger: message`, with line breaks, control and
    bidirectional characters escaped, tracebacks included) or "json" (one ASCII JSON object
    per line: time, level, service, logger, message, and exception or stack when there is
    one); None reads TANDEM_LOG_FORMAT, "text" when unset. Raises ValueError for another."""
    die_with_supervisor()  # every service calls this first
    if log_format is None:
        log_format = os.environ.get("TANDEM_LOG_FORMAT") or "text"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter(name, log_format))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def log_formatter(service: str, log_format: str = "text") -> logging.Formatter:
    """The formatter `setup_logging` installs for `service`. Raises ValueError for a format
    other than "text" and "json"."""
    log_format = log_format.strip().lower()
    if log_format == "json":
        return _JsonLogFormatter(service)
    if log_format == "text":
        service = escape_log_text(service).replace("%", "%%")
        return _OneLineLogFormatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
    raise ValueError(f"log format must be 'text' or 'json', got {log_format!r}")


# What could end a line or act on a terminal: C0 and C1 controls, DEL, the Unicode line and
# paragraph separators, and the bidirectional marks and overrides that reorder shown text.
_UNSAFE_LOG_CHARS = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def escape_log_text(text: str) -> str:
    """`text` with every unsafe character written as its Python escape (\\n, \\x1b,
    \\u2028, ...): one line, inert in a terminal. Backslashes are kept as they are."""
    return _UNSAFE_LOG_CHARS.sub(lambda m: ascii(m.group())[1:-1], text)


class _OneLineLogFormatter(logging.Formatter):
    """A `logging.Formatter` whose whole output (message, traceback, stack) is escaped."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_log_text(super().format(record))


class _JsonLogFormatter(logging.Formatter):
    """One JSON object per record; ASCII only, so it is one line whatever the record holds."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC)
        entry = {
            "time": when.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=True)


def configure_native_libraries(
    environ: MutableMapping[str, str] = os.environ, device: str = "cpu"
) -> None:
    """Set up UCX and NIXL for a process whose KV cache lives on `device`; call it before
    creating a NIXL transport.

    UCX reads its settings from the environment when an agent creates its backend, so the
    settings the NIXL transport is tuned for (`ucx_env_defaults(device)`) must be in `environ`
    before the transport is created; a value already set wins, so a deployment can override
    each one. Child processes started afterwards inherit them. NIXL logs every agent creation
    at INFO on stdout: its logger is set to WARNING unless NIXL_LOG_LEVEL is set (NIXL
    applies that level itself).
    """
    # Imported here, not at the top: loading NIXL costs every importer of this module, and
    # importing nixl configures its logger at INFO, which would undo an earlier setLevel.
    from tandem.transfer.nixl import ucx_env_defaults

    for key, value in ucx_env_defaults(device).items():
        environ.setdefault(key, value)
    if not environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


async def run_until_signal(
    start: Callable[[], Awaitable[None]],
    drain: Callable[[], Awaitable[None]],
    ready_line: Callable[[], str],
) -> None:
    """Start a server, print its ready line on stdout, drain on SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await start()
    # The supervisor (tandem up, tests) waits for this line to learn the bound address.
    print(ready_line(), flush=True)
    await stop.wait()
    await drain()


async def start_grpc_server(
    host: str,
    port: int,
    service_names: tuple[str, ...],
    add_servicers: Callable[[grpc.aio.Server], None],
    health_servicer: health.aio.HealthServicer,
    options: list[tuple[str, Any]] | None = None,
    serving: bool = True,
    auth_rules: Mapping[str, Rule] | None = None,
    auth: AuthConfig | None = None,
    keyring: KeyRing | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start an aio server with our services, gRPC health (SERVING) and reflection.

    With `auth_rules` (tandem.services.common.security: "/pkg.Service/Method" or "pkg.Service" ->
    Open(), Internal() or Bearer(scope)), every call is first checked by an AuthInterceptor
    holding `auth` (cluster secret, internal TLS) and `keyring` (Bearer keys); health and
    reflection are Open unless the rules say otherwise, methods they do not name Internal.
    Then every call goes through `StatusInterceptor` (a request that does not decode ends with
    INVALID_ARGUMENT, an unexpected handler error with INTERNAL, neither naming a Python
    class); `options` add to or override `SERVER_OPTIONS`. `credentials`: serve TLS
    (security.server_port_credentials(auth) for mutual TLS); None: plaintext.
    Health reports SERVING at once, or NOT_SERVING with `serving=False` (the caller sets
    SERVING when it is ready). Returns (server, bound port); port 0 picks a free one.
    Raises RuntimeError when the address cannot be bound, ValueError or OSError when the
    cluster secret cannot be loaded."""
    merged: dict[str, Any] = dict(SERVER_OPTIONS)
    merged.update(options or ())
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if auth_rules is not None:
        rules: dict[str, Rule] = {health.SERVICE_NAME: Open(), reflection.SERVICE_NAME: Open()}
        rules.update(auth_rules)
        interceptors.append(AuthInterceptor(rules, auth=auth, keyring=keyring))
    interceptors.append(StatusInterceptor())
    server = grpc.aio.server(interceptors=interceptors, options=list(merged.items()))
    add_servicers(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    if credentials is not None:
        bound = server.add_secure_port(address, credentials)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"cannot listen on {host}:{port}")
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in (*service_names, ""):
        # Set before the server starts, so no probe sees the servicer's default.
        await health_servicer.set(name, status)
    await server.start()
    return server, bound
