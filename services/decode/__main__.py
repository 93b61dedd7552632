"""`python -m tandem.services.decode --model-dir DIR [--redis-url URL] ...` (flags =
WorkerConfig)."""

from __future__ import annotations

from tandem.services.common.worker.shell import run_worker
from tandem.services.decode.server import DecodeServer
from tandem.types import Role

if __name__ == "__main__":
    run_worker(DecodeServer, Role.DECODE)
