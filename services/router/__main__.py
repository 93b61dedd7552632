"""`python -m tandem.services.router --model-dir DIR --redis-url URL ...` (flags = RouterConfig)."""

from __future__ import annotations

import asyncio

from tandem.services.common.runtime.flags import parse_config
from tandem.services.common.runtime.process import run_until_signal, setup_logging
from tandem.services.router.server import RouterConfig, RouterServer


def main() -> None:
    config = parse_config(RouterConfig, prog="python -m tandem.services.router")
    setup_logging("router")

    async def run() -> None:
        server = RouterServer(config)
        await run_until_signal(server.start, server.stop, lambda: f"READY router {server.address}")

    asyncio.run(run())


if __name__ == "__main__":
    main()
