"""`python -m services.decode --model-dir DIR [--redis-url URL] ...` (flags = WorkerConfig)."""

from __future__ import annotations

import asyncio

from services.common.flags import parse_config
from services.common.process import run_until_signal, setup_logging
from services.common.worker import WorkerConfig
from services.decode.server import DecodeServer


def main() -> None:
    config = parse_config(WorkerConfig, prog="python -m services.decode")
    setup_logging("decode")

    async def run() -> None:
        server = DecodeServer(config)
        await run_until_signal(
            server.start, server.drain_and_stop, lambda: f"READY decode {server.address}"
        )

    asyncio.run(run())


if __name__ == "__main__":
    main()
