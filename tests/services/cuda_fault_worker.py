"""`python -m tests.services.cuda_fault_worker <decode worker flags>`: a real decode worker
whose engine step fails as a CUDA fault does (the RuntimeError of an illegal memory access)
while a request whose id starts with "cuda-fault" is in the engine, and with an ordinary
ValueError while one starting with "plain-fault" is."""

from __future__ import annotations

from tandem.engine.engine import LLMEngine
from tandem.services.common.worker.shell import run_worker
from tandem.services.decode.server import DecodeServer

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"
_real_step = LLMEngine.step


def _step(self: LLMEngine):  # type: ignore[no-untyped-def]
    ids = [r.request_id for r in self.scheduler.requests()]
    if any(rid.startswith("cuda-fault") for rid in ids):
        raise RuntimeError(ILLEGAL_ADDRESS)
    if any(rid.startswith("plain-fault") for rid in ids):
        raise ValueError("an ordinary step failure")
    return _real_step(self)


LLMEngine.step = _step  # type: ignore[method-assign]

if __name__ == "__main__":
    run_worker(DecodeServer, "decode")
