"""`python -m tandem.services.prefill --model-dir DIR [--redis-url URL] ...` (flags =
WorkerConfig)."""

from __future__ import annotations

from tandem.services.common.worker.shell import run_worker
from tandem.services.prefill.server import PrefillServer
from tandem.types import Role

if __name__ == "__main__":
    run_worker(PrefillServer, Role.PREFILL)
