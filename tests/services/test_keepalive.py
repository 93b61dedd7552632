"""Keepalive between services: a client with `channel_options` finds a frozen (SIGSTOPped)
server within seconds instead of waiting forever, and a server from `start_grpc_server`
accepts that client's pings instead of closing the connection (GOAWAY "too_many_pings").

The server is `start_grpc_server` with only the services every server has (health), in a
process of its own so that it can be stopped; health's Watch is the long-running call."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.common.runtime.process import channel_options

REPO = Path(__file__).resolve().parents[2]
SERVER = textwrap.dedent(
    """
    import asyncio

    from grpc_health.v1 import health

    from tandem.services.common.runtime.process import start_grpc_server


    async def main() -> None:
        server, port = await start_grpc_server(
            "127.0.0.1", 0, (), lambda server: None, health.aio.HealthServicer()
        )
        print("READY", f"127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()


    asyncio.run(main())
    """
)
# Bounds on the waits, not expectations: with 1 s keepalive the call fails after about 2 s.
FAIL_WITHIN_S = 15.0
IDLE_S = 4.0
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"server failed to start: {line!r}"
        yield proc, line.split()[-1]
    finally:
        proc.send_signal(signal.SIGCONT)  # a stopped process handles SIGTERM only once resumed
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_call_to_a_frozen_server_fails_with_unavailable(server) -> None:
    proc, address = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address, options=channel_options(1.0)) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            assert (await call.read()).status == SERVING
            proc.send_signal(signal.SIGSTOP)
            # The server sends nothing more either way; without keepalive this read would
            # wait forever (asyncio.wait_for then raises TimeoutError and the test fails).
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call.read(), FAIL_WITHIN_S)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_an_idle_pinging_channel_stays_connected(server) -> None:
    _, address = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address, options=channel_options(1.0)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(health_pb2.HealthCheckRequest())).status == SERVING
            ready = grpc.ChannelConnectivity.READY
            assert channel.get_state() == ready
            # A server that polices pings (gRPC's defaults) answers the third or so with
            # GOAWAY "too_many_pings", which moves the channel out of READY; a later call
            # would then still succeed on a new connection, so the state is what tells.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(channel.wait_for_state_change(ready), IDLE_S)
            assert channel.get_state() == ready
            assert (await stub.Check(health_pb2.HealthCheckRequest())).status == SERVING

    asyncio.run(main())


def test_channel_options_name_the_keepalive_settings() -> None:
    options = dict(channel_options(0.5))
    assert options["grpc.keepalive_time_ms"] == 500
    assert options["grpc.keepalive_timeout_ms"] == 500
    assert options["grpc.http2.ping_timeout_ms"] == 500
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_pings_without_data"] == 0
    assert options["grpc.use_local_subchannel_pool"] == 1  # a new channel = new connections
    with pytest.raises(ValueError):
        channel_options(0.0)
