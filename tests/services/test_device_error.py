"""A CUDA fault in an engine step ends the worker instead of leaving a zombie: health
NOT_SERVING, out of the registry, exit status 3 (tandem up and Kubernetes restart it; the
router moves its requests). An ordinary step error still fails only the requests of that
step, and the worker goes on serving. The fault is injected into a real worker process
(tests/services/cuda_fault_worker.py) and, for the health check, into one in this process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.config import CacheConfig, EngineConfig
from tandem.services.common.redis.registry import Registry
from tandem.services.common.worker.config import WorkerConfig
from tandem.services.common.worker.shell import DEVICE_ERROR_EXIT
from tandem.services.decode.server import DecodeServer
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.conftest import KV_BYTES, stop
from tests.services.cuda_fault_worker import ILLEGAL_ADDRESS

REPO = Path(__file__).resolve().parents[2]


async def _decode(channel: grpc.aio.Channel, request_id: str) -> str:
    """How a Decode stream ended: its finish reason ("STOP", "LENGTH", "ABORT"), or the status
    code it failed with."""
    stub = wgrpc.DecodeWorkerStub(channel)
    request = wpb.DecodeRequest(request_id=request_id, prompt_token_ids=[5, 6, 7])
    try:
        last = [msg async for msg in stub.Decode(request)][-1]
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    assert last.WhichOneof("kind") == "complete"
    return rpb.FinishReason.Name(last.complete.finish_reason).removeprefix("FINISH_REASON_")


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="")
    )
    return int(reply.status)


def test_device_error_makes_the_worker_not_serving_deregistered_and_exit(
    tiny_model_dir: Path, redis_url: str
) -> None:
    config = WorkerConfig(
        engine=EngineConfig(str(tiny_model_dir), cache=CacheConfig(kv_cache_bytes=8 << 20)),
        transport="local",
        redis_url=redis_url,
        worker_id="decode-faulty",
        registry_ttl_s=60.0,  # gone from the registry only by deregistering
    )
    server = DecodeServer(config)
    real_step = server.engine.step
    errors: list[BaseException] = []

    def step():  # type: ignore[no-untyped-def]
        if errors and server.engine.has_request("doomed"):
            raise errors.pop()
        return real_step()

    server.engine.step = step  # type: ignore[method-assign]
    exited: asyncio.Queue[int] = asyncio.Queue()
    server.exit_process = exited.put_nowait  # type: ignore[method-assign]

    async def main() -> None:
        await server.start()
        registry = Registry(redis_url)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                errors.append(ValueError("an ordinary step failure"))
                assert await _decode(channel, "doomed") == "ABORT"  # that step's requests
                assert await _decode(channel, "fine") == "LENGTH"  # and still serving
                assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
                assert exited.empty()
                assert [w.worker_id for w in await registry.list_workers()] == ["decode-faulty"]

                errors.append(RuntimeError(ILLEGAL_ADDRESS))
                call = asyncio.create_task(_decode(channel, "doomed"))
                assert await asyncio.wait_for(exited.get(), 10) == DEVICE_ERROR_EXIT
                assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await registry.list_workers() == []
                assert server.loop.device_error is not None
                call.cancel()
        finally:
            await registry.close()
            await server.stop()

    asyncio.run(main())


def test_a_real_worker_process_exits_on_a_cuda_fault(tiny_model_dir: Path, redis_url: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.services.cuda_fault_worker", "--model-dir",
         str(tiny_model_dir), "--redis-url", redis_url, "--worker-id", "decode-cuda",
         "--kv-cache-bytes", str(KV_BYTES), "--transport", "local", "--registry-ttl-s", "60"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read() if proc.stderr else line
        address = line.split()[-1]

        async def main() -> tuple[str, str, list[str]]:
            async with grpc.aio.insecure_channel(address) as channel:
                plain = await _decode(channel, "plain-fault-1")
                after = await _decode(channel, "fine-1")
                fault = await _decode(channel, "cuda-fault-1")
            registry = Registry(redis_url)
            try:
                workers = [w.worker_id for w in await registry.list_workers()]
                return plain, f"{after}/{fault}", workers
            finally:
                await registry.close()

        # The stream of the faulting request breaks when the process goes: UNAVAILABLE, the
        # router's "worker died" path, which moves the request to another worker.
        plain, outcome, registered = asyncio.run(main())
        assert proc.wait(timeout=30) == DEVICE_ERROR_EXIT
        assert plain == "ABORT" and outcome == "LENGTH/UNAVAILABLE"
        assert registered == []
        log = proc.stderr.read() if proc.stderr else ""
        assert "device error on cpu" in log and ILLEGAL_ADDRESS in log and "NOT_SERVING" in log
    finally:
        stop(proc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    "command",
    [
        ["-m", "tandem.services.decode", "--transport", "local", "--model-dir", "MODEL"],
        ["-m", "tandem.services.cli", "generate", "--model", "MODEL", "--max-tokens", "1", "hi"],
        ["-m", "tandem.services.cli", "up", "--model", "MODEL"],
    ],
    ids=["worker", "generate", "up"],
)
def test_asking_for_cuda_without_it_fails_fast(tiny_model_dir: Path, command: list[str]) -> None:
    args = [str(tiny_model_dir) if a == "MODEL" else a for a in command]
    proc = subprocess.run(
        [sys.executable, *args, "--device", "cuda"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "device 'cuda' asked for" in proc.stderr
    assert f"torch {torch.__version__}" in proc.stderr  # and its CUDA build, or none
    assert "Traceback" not in proc.stderr
