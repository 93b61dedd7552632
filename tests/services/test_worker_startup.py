"""A worker reports NOT_SERVING (and refuses requests with UNAVAILABLE) until its warm-up
has run, then SERVING: probes and routers never send traffic to a cold worker."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.config import CacheConfig, EngineConfig
from tandem.services.common.worker.config import WorkerConfig
from tandem.services.decode.server import DecodeServer
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc


def test_not_serving_until_warm_up_completes(tiny_model_dir: Path) -> None:
    config = WorkerConfig(
        engine=EngineConfig(str(tiny_model_dir), cache=CacheConfig(kv_cache_bytes=8 << 20)),
        transport="local",
    )
    server = DecodeServer(config)
    release = threading.Event()
    warmed: list[bool] = []
    real_warm_up = server.engine.warm_up

    def slow_warm_up() -> None:  # runs on the engine thread
        assert release.wait(30), "test did not release the warm-up"
        real_warm_up()
        warmed.append(True)

    server.engine.warm_up = slow_warm_up  # type: ignore[method-assign]

    async def main() -> None:
        starting = asyncio.create_task(server.start())
        while not server.address:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "tandem.v1.DecodeWorker"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                call = wgrpc.DecodeWorkerStub(channel).Decode(
                    wpb.DecodeRequest(request_id="r", prompt_token_ids=[5, 6, 7])
                )
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "starting" in (err.value.details() or "")
            assert not warmed
            release.set()
            await starting
            assert warmed == [True]
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stream = wgrpc.DecodeWorkerStub(channel).Decode(
                wpb.DecodeRequest(request_id="r2", prompt_token_ids=[5, 6, 7])
            )
            kinds = [msg.WhichOneof("kind") async for msg in stream]
            assert kinds[-1] == "complete"
        await server.stop()

    asyncio.run(main())
