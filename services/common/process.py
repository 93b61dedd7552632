"""Process plumbing shared by the service entry points: logging, signals, run-until-stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


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


def run_worker(server_cls: type, role: str) -> None:
    """Entry point of `python -m services.<role>`: flags -> WorkerConfig -> serve until stop."""
    from services.common.flags import parse_config
    from services.common.worker import WorkerConfig

    config = parse_config(WorkerConfig, prog=f"python -m services.{role}")
    setup_logging(role)

    async def run() -> None:
        server = server_cls(config)
        await run_until_signal(
            server.start, server.drain_and_stop, lambda: f"READY {role} {server.address}"
        )

    asyncio.run(run())
