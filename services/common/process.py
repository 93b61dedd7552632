"""Process plumbing shared by the services: logging and native library settings, signals,
run-until-stop, gRPC server."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


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


def setup_logging(name: str) -> None:
    """Log to stderr as `name`."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def configure_native_libraries(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set up UCX and NIXL for this process; call it before creating a NIXL transport.

    UCX reads its settings from the environment when an agent creates its backend, so
    `UCX_ENV_DEFAULTS` (what the NIXL transport is tuned for) must be in `environ` before the
    transport is created; a value already set wins, so a deployment can override each one.
    Child processes started afterwards inherit them. NIXL logs every agent creation at INFO
    on stdout: its logger is set to WARNING unless NIXL_LOG_LEVEL is set (NIXL applies that
    level itself).
    """
    # Imported here, not at the top: loading NIXL costs every importer of this module, and
    # importing nixl configures its logger at INFO, which would undo an earlier setLevel.
    from tandem.transfer.nixl import UCX_ENV_DEFAULTS

    for key, value in UCX_ENV_DEFAULTS.items():
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
) -> tuple[grpc.aio.Server, int]:
    """Start an aio server with our services, gRPC health (SERVING) and reflection.

    Health reports SERVING at once, or NOT_SERVING with `serving=False` (the caller sets
    SERVING when it is ready). Returns (server, bound port); port 0 picks a free one.
    Raises RuntimeError when the address cannot be bound."""
    server = grpc.aio.server(options=options)
    add_servicers(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
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
