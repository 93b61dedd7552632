"""`python -m services.prefill --model-dir DIR [--redis-url URL] ...` (flags = WorkerConfig)."""

from __future__ import annotations

from services.common.worker.shell import run_worker
from services.prefill.server import PrefillServer

if __name__ == "__main__":
    run_worker(PrefillServer, "prefill")
