"""The ratio controller service against a real Redis: heartbeat stats and router timings in,
decisions out through an actuator, and the admin gRPC API (over a socket) that operators
use through `tandem ctl`."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import grpc
import pytest

from tandem.control import SLA, ControlConfig, HostCapacity, RequestSample
from tandem.ctl import format_decisions, format_status
from tandem.services.common.redis.registry import Registry, WorkerInfo
from tandem.services.common.redis.request_log import RequestLog, RequestLogReader
from tandem.services.controller.actuators import ActuatorError, NoActuator
from tandem.services.controller.config import ControllerConfig
from tandem.services.controller.server import Controller
from tandem.v1 import admin_pb2 as apb
from tandem.v1 import admin_pb2_grpc as agrpc

MODEL = "m"
CONTROL = ControlConfig(min_requests=5, scale_up_cooldown_s=0)


def config(redis_url: str, control: ControlConfig = CONTROL, **kw: object) -> ControllerConfig:
    base: dict[str, object] = dict(
        redis_url=redis_url, model_id=MODEL, port=0, metrics_port=0, interval_s=60.0,
        window_s=60.0, sla=SLA(ttft_p90_ms=500, itl_p90_ms=100), control=control,
    )  # fmt: skip
    base.update(kw)
    return ControllerConfig(**base)  # type: ignore[arg-type]


def info(worker_id: str, role: str, **stats: object) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=role, address=f"{worker_id}:1", model=MODEL, epoch=1,
        num_blocks=1000, num_free_blocks=900, **stats,  # type: ignore[arg-type]
    )  # fmt: skip


async def prefill_heavy(registry: Registry, log: RequestLog) -> None:
    """One saturated prefill worker with a backlog, one lightly loaded decode worker, and
    requests whose TTFT misses the 500 ms target."""
    await registry.register(
        info("p0", "prefill", busy_frac=1.0, tokens_per_s=2000.0, step_ms=80.0,
             queued_prefill_tokens=6000)
    )  # fmt: skip
    await registry.register(
        info("d0", "decode", busy_frac=1.0, tokens_per_s=200.0, step_ms=20.0, num_running=4,
             host_onload_tokens_per_s=50_000.0, disk_onload_tokens_per_s=8_000.0,
             host_tier_blocks=120, disk_tier_blocks=900, tier_hit_tokens=4096,
             speculative="draft", draft_format="draft-fmt")
    )  # fmt: skip
    for _ in range(10):
        log.record(RequestSample(time.time(), 1500.0, 20.0, 1000, 32, disaggregated=True))
    await log.flush()


class FlakyActuator(NoActuator):
    """A NoActuator whose scale() fails while `broken` (a cluster API outage)."""

    name = "flaky"

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.calls: list[dict[str, int]] = []

    async def scale(self, target: Mapping[str, int]) -> None:
        self.calls.append(dict(target))
        if self.broken:
            raise ActuatorError("kubernetes: patch deployments/x/scale: 503 Service Unavailable")
        await super().scale(target)


class HostActuator(NoActuator):
    """A NoActuator on a host that holds `capacity` workers (what LocalActuator measures)."""

    name = "local"

    def __init__(self, capacity: HostCapacity) -> None:
        super().__init__()
        self.host = capacity

    async def capacity(self) -> HostCapacity | None:
        return self.host


HOST_WHY = "2 cores, one worker per core; 20.0 GiB available less 1.0 GiB reserve fits 11 more"


def test_host_capacity_clamps_and_an_undone_scale_up_is_explained(redis_url: str) -> None:
    """The host first holds no more workers (clamped, in status and explain); then room for
    two: prefill scales 1 -> 3, its workers serve, but together they compute what one did
    and fewer requests meet the SLA: the scale-up is undone, and `tandem ctl explain` says
    why."""
    t0 = time.time()
    clock = [t0]

    async def body() -> None:
        registry = Registry(redis_url, ttl_s=30)
        log = RequestLog(redis_url, MODEL)
        actuator = HostActuator(HostCapacity(2, 2, HOST_WHY))
        control = dataclasses.replace(
            CONTROL, scale_up_trial_s=10.0, worker_start_timeout_s=60.0, undo_cooldown_s=100.0
        )
        controller = Controller(config(redis_url, control), actuator, clock=lambda: clock[0])
        await controller.start(run_loop=False)

        async def tick_at(offset_s: float) -> Any:
            clock[0] = t0 + offset_s
            record = await controller.tick()
            assert record is not None and record.applied
            return record.decision

        async def timings(offset_s: float, num_met: int) -> None:
            for i in range(10):
                ttft = 200.0 if i < num_met else 1500.0
                log.record(RequestSample(t0 + offset_s, ttft, 20.0, 1000, 32))
            await log.flush()

        async def prefill_workers(n: int) -> None:
            for i in range(n):
                await registry.register(
                    info(f"p{i}", "prefill", busy_frac=1.0, tokens_per_s=2000.0 / n,
                         step_ms=80.0, queued_prefill_tokens=6000 // n)
                )  # fmt: skip

        await tick_at(0.0)  # positions the request reader; counts to the bounds (1, 1)
        await prefill_workers(1)
        await registry.register(info("d0", "decode", busy_frac=0.2, step_ms=20.0, num_running=2))
        await timings(1.0, num_met=4)
        clamped = await tick_at(2.0)
        assert clamped.target == {"prefill": 1, "decode": 1}
        assert clamped.reasons["prefill"].startswith(
            f"hold 1: the host holds 2 workers and runs 2 ({HOST_WHY}); was: scale up 1 -> 3: "
        )
        status = controller.status()
        assert (status.capacity.max_workers, status.capacity.num_workers) == (2, 2)
        assert (
            f"host: holds 2 workers, 2 running, no room to add ({HOST_WHY})"
            in format_status(status).splitlines()
        )

        actuator.host = HostCapacity(4, 2, HOST_WHY)
        up = await tick_at(3.0)
        assert up.target == {"prefill": 3, "decode": 1}
        await prefill_workers(3)  # all three serve, sharing one core's worth of work
        judging = await tick_at(4.0)
        assert judging.reasons["prefill"].endswith(
            "but judging scale up 1 -> 3: 0/10 s of goodput since its workers serve"
        )
        assert [(r.current, r.ready, r.live) for r in controller.status().roles] == [
            (3, 3, 3),
            (1, 1, 1),
        ]
        await timings(14.0, num_met=1)
        undone = await tick_at(14.0)
        assert undone.target == {"prefill": 1, "decode": 1}
        # Before: 4 met in the 3 s the window held (1.33 req/s); after: 1 in 10 s.
        assert undone.reasons["prefill"] == (
            "scale up 1 -> 3 undone: goodput 0.10 req/s within the SLA after, 1.33 before; its "
            "workers computed 2000 tok/s, 2000 before; back to 1, no prefill scale-up for 100 s"
        )
        assert await actuator.current({}) == {"prefill": 1, "decode": 1}
        async with grpc.aio.insecure_channel(controller.address) as channel:
            explained = await agrpc.AdminStub(channel).Explain(apb.ExplainRequest(limit=5))
        text = format_decisions(explained)
        assert "prefill 3 -> 1, decode 1" in text
        assert "    prefill: scale up 1 -> 3 undone: goodput 0.10 req/s" in text
        assert "prefill_goodput_before_rps=1.333" in text and "host_max_workers=4" in text
        assert "    prefill: hold 1: the host holds 2 workers and runs 2" in text
        await controller.stop()
        await log.stop()
        await registry.close()

    asyncio.run(body())


def test_request_log_round_trip(redis_url: str) -> None:
    async def body() -> None:
        import redis.asyncio as aioredis

        raw = aioredis.Redis.from_url(redis_url)
        reader = RequestLogReader(raw, MODEL)
        log = RequestLog(redis_url, MODEL)
        log.record(RequestSample(1.0, 10.0, 2.0, 5, 3))  # before the reader's first read
        await log.flush()
        assert await reader.read_new() == []  # the first read only marks the position
        samples = [RequestSample(2.0 + i, 100.0 + i, 5.5, 64, 8, 16, i % 2 == 0) for i in range(3)]
        for s in samples:
            log.record(s)
        await log.flush()
        assert await reader.read_new() == samples
        assert await reader.read_new() == []
        await raw.xadd("tandem:requests:" + MODEL, {"t": "x"})  # garbage is skipped
        log.record(samples[0])
        await log.flush()
        assert await reader.read_new() == [samples[0]]
        await log.stop()
        await raw.aclose()

    asyncio.run(body())


def test_request_log_buffers_while_redis_is_down() -> None:
    async def body() -> None:
        log = RequestLog("redis://127.0.0.1:1", MODEL, max_buffer=3)  # nothing listens
        for i in range(5):
            log.record(RequestSample(float(i), 1.0, 1.0, 1, 1))
        await log.flush()  # fails quietly and keeps the newest 3
        assert [s.t for s in log._buffer] == [2.0, 3.0, 4.0]

    asyncio.run(body())


def test_controller_scales_prefill_from_heartbeats_and_timings(redis_url: str) -> None:
    async def body() -> None:
        registry = Registry(redis_url, ttl_s=30)
        log = RequestLog(redis_url, MODEL)
        controller = Controller(config(redis_url), NoActuator())
        await controller.start(run_loop=False)
        first = await controller.tick()  # positions the request reader
        # No workers yet: the counts are raised to the bounds' minimum of one per role.
        assert first is not None and first.decision.target == {"prefill": 1, "decode": 1}
        assert first.decision.reasons["prefill"] == "0 outside bounds [1, 8]"
        await prefill_heavy(registry, log)
        record = await controller.tick()
        assert record is not None and record.applied
        d = record.decision
        # 2000 tok/s computed + 6000 queued over the 0.5 s TTFT target = 14000 tok/s of
        # demand against 2000 tok/s per worker at 70%: 10 workers wanted, +2 per step.
        assert d.current == {"prefill": 1, "decode": 1}
        assert d.target == {"prefill": 3, "decode": 1}
        assert d.reasons["prefill"].startswith("scale up 1 -> 3: demand 14000 tok/s")
        assert "TTFT p90 1500 ms > SLA 500 ms" in d.reasons["prefill"]
        status = controller.status()
        assert status.mode == "auto" and status.actuator == "none"
        assert status.window_requests == 10
        assert status.sla_attainment == 0.0  # every request missed the TTFT target
        assert status.ttft_p90_ms == 1500.0
        assert [(r.role, r.current, r.desired, r.live) for r in status.roles] == [
            ("prefill", 3, 3, 1),
            ("decode", 1, 1, 1),
        ]
        await controller.stop()
        await log.stop()
        await registry.close()

    asyncio.run(body())


def test_actuator_failure_is_reported_and_retried(redis_url: str) -> None:
    async def body() -> None:
        registry = Registry(redis_url, ttl_s=30)
        log = RequestLog(redis_url, MODEL)
        actuator = FlakyActuator()
        # An hour-long cooldown that a retry must not wait for.
        cfg = config(redis_url, dataclasses.replace(CONTROL, scale_up_cooldown_s=3600))
        controller = Controller(cfg, actuator)
        await controller.start(run_loop=False)
        for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
            await registry.register(info(worker_id, role))  # idle: no change, no cooldown
        assert (await controller.tick()).decision.changed is False  # type: ignore[union-attr]
        actuator.broken = True
        await prefill_heavy(registry, log)
        failed = await controller.tick()
        assert failed is not None and not failed.applied
        assert "503 Service Unavailable" in failed.error
        assert "503" in controller.status().last_error
        actuator.broken = False
        retried = await controller.tick()  # at once, despite the hour-long cooldown
        assert retried is not None and retried.applied
        assert actuator.calls == [{"prefill": 3, "decode": 1}] * 2
        assert controller.status().last_error == ""
        await controller.stop()
        await log.stop()
        await registry.close()

    asyncio.run(body())


def test_admin_api_over_grpc(redis_url: str) -> None:
    async def body() -> None:
        registry = Registry(redis_url, ttl_s=30)
        log = RequestLog(redis_url, MODEL)
        controller = Controller(config(redis_url), NoActuator())
        await controller.start(run_loop=False)
        await controller.tick()
        await prefill_heavy(registry, log)
        await controller.tick()
        async with grpc.aio.insecure_channel(controller.address) as channel:
            stub = agrpc.AdminStub(channel)
            status = await stub.Status(apb.StatusRequest())
            text = format_status(status)
            assert "mode: auto" in text and "prefill" in text and "scale up 1 -> 3" in text
            # The heartbeats' KV tier rates and use reach `tandem ctl top` (0: no such tier).
            rates = {
                w.worker_id: (w.host_onload_tokens_per_s, w.disk_onload_tokens_per_s)
                for w in status.workers
            }
            assert rates == {"p0": (0.0, 0.0), "d0": (50_000.0, 8_000.0)}
            use = {
                w.worker_id: (w.host_tier_blocks, w.disk_tier_blocks, w.tier_hit_tokens)
                for w in status.workers
            }
            assert use == {"p0": (0, 0, 0), "d0": (120, 900, 4096)}
            # And their speculative method and draft model's format (issue 45).
            spec = {w.worker_id: (w.speculative, w.draft_format) for w in status.workers}
            assert spec == {"p0": ("", ""), "d0": ("draft", "draft-fmt")}
            explained = await stub.Explain(apb.ExplainRequest(limit=1))
            assert len(explained.decisions) == 1
            d = explained.decisions[0]
            assert dict(d.target) == {"prefill": 3, "decode": 1} and d.applied
            assert d.figures["prefill_capacity_tps"] == pytest.approx(2000.0)
            assert "prefill 1 -> 3" in format_decisions(explained)

            pinned = await stub.SetRatio(apb.SetRatioRequest(prefill=2, decode=4))
            assert pinned.mode == "manual"
            assert [(r.role, r.desired) for r in pinned.roles] == [("prefill", 2), ("decode", 4)]
            # The scale-up 1 -> 3 was on probation; an operator's pin ends it, unjudged.
            assert pinned.roles[0].reason == (
                "pinned by operator at 2; scale up 1 -> 3 no longer judged: pinned by operator"
            )

            bad_ratios = [
                (apb.SetRatioRequest(prefill=9, decode=1), "prefill: 9"),
                (apb.SetRatioRequest(prefill=1, decode=0), "decode: 0"),
            ]
            for bad, field in bad_ratios:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SetRatio(bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = err.value.details() or ""
                assert field in details and "max_" in details

            sla = await stub.SetSla(apb.SetSlaRequest(sla=apb.Sla(itl_p90_ms=50.0)))
            assert (sla.sla.ttft_p90_ms, sla.sla.itl_p90_ms) == (500.0, 50.0)
            for bad_sla in (apb.Sla(), apb.Sla(ttft_p90_ms=-1)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SetSla(apb.SetSlaRequest(sla=bad_sla))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Explain(apb.ExplainRequest(limit=-1))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # A restarted controller keeps the operator's pin and SLA (kept in Redis).
        await controller.stop()
        again = Controller(config(redis_url), NoActuator())
        await again.start(run_loop=False)
        assert again.state.pinned == (2, 4)
        assert (again.sla.ttft_p90_ms, again.sla.itl_p90_ms) == (500.0, 50.0)
        async with grpc.aio.insecure_channel(again.address) as channel:
            auto = await agrpc.AdminStub(channel).Auto(apb.AutoRequest())
            assert auto.mode == "auto"
        assert again.state.pinned is None
        await again.stop()
        await log.stop()
        await registry.close()

    asyncio.run(body())


def test_status_before_any_traffic_says_so(redis_url: str) -> None:
    async def body() -> None:
        controller = Controller(config(redis_url), NoActuator())
        await controller.start(run_loop=False)
        status = controller.status()
        assert not status.HasField("capacity")  # no host limit without the local actuator
        assert math.isnan(status.sla_attainment) and math.isnan(status.ttft_p90_ms)
        assert "n/a" in format_status(status)
        assert status.roles[0].reason == "no decision yet"
        await controller.stop()

    asyncio.run(body())


def test_metrics_endpoint_exposes_replicas(redis_url: str) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def body() -> str:
        registry = Registry(redis_url, ttl_s=30)
        log = RequestLog(redis_url, MODEL)
        controller = Controller(config(redis_url, metrics_port=port), NoActuator())
        await controller.start(run_loop=False)
        await controller.tick()
        await prefill_heavy(registry, log)
        await controller.tick()
        url = f"http://127.0.0.1:{port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        await controller.stop()
        await log.stop()
        await registry.close()
        return text.decode()

    text = asyncio.run(body())
    assert 'tandem_controller_replicas{kind="desired",role="prefill"} 3.0' in text
    assert "tandem_controller_sla_attainment 0.0" in text
    # prefill: 0 -> 1 (bounds, first tick) and 1 -> 3; decode: 0 -> 1.
    assert 'tandem_controller_decisions_total{applied="true",role="prefill"} 2.0' in text
    assert 'tandem_controller_decisions_total{applied="true",role="decode"} 1.0' in text


def test_every_policy_knob_and_sla_target_is_a_controller_flag() -> None:
    """ControllerConfig holds a ControlConfig and an SLA; flags (and Helm values) flatten them
    by leaf name, so a knob added to the policy is a flag at once, with the same default."""
    from tandem.services.common.runtime import flags

    by_name = {leaf.name: leaf for leaf in flags.leaves(ControllerConfig)}
    for nested, cls in (("control", ControlConfig), ("sla", SLA)):
        for f in dataclasses.fields(cls):
            leaf = by_name.get(f.name)
            assert leaf is not None, f"no controller flag for {cls.__name__}.{f.name}"
            assert leaf.path == (nested, f.name)
            assert leaf.default == f.default, f.name
    assert by_name["window_s"].path == ("window_s",)  # the controller's own, not the policy's
    argv = ["--prefill-backlog-s", "10", "--max-down-step", "2", "--ttft-p90-ms", "800"]
    cfg = flags.parse_config(ControllerConfig, argv, environ={})
    assert cfg.control == dataclasses.replace(
        ControlConfig(), prefill_backlog_s=10.0, max_down_step=2
    )
    assert cfg.sla == SLA(ttft_p90_ms=800.0, itl_p90_ms=SLA().itl_p90_ms)


def test_tandem_ctl_command_line(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`tandem ctl ...` as an operator types it, against a controller on a real socket."""
    from tandem.services.cli.main import main as cli

    async def body() -> list[int]:
        controller = Controller(config(redis_url), NoActuator())
        await controller.start(run_loop=False)
        await controller.tick()
        ctl = ["ctl", "--address", controller.address]
        codes = [
            await asyncio.to_thread(cli, [*ctl, "set-ratio", "2", "3"]),
            await asyncio.to_thread(cli, [*ctl, "status"]),
            await asyncio.to_thread(cli, [*ctl, "set-sla", "--ttft-p90", "800"]),
            await asyncio.to_thread(cli, [*ctl, "explain", "-n", "1"]),
            await asyncio.to_thread(cli, [*ctl, "auto"]),
            await asyncio.to_thread(cli, [*ctl, "set-ratio", "0", "3"]),  # below min_prefill
        ]
        await controller.stop()
        codes.append(await asyncio.to_thread(cli, [*ctl, "status"]))  # nobody listens now
        return codes

    codes = asyncio.run(body())
    out, err = capsys.readouterr()
    assert codes == [0, 0, 0, 0, 0, 2, 2]
    assert "mode: manual" in out and "pinned by operator at 2" in out
    assert "TTFT p90 <= 800 ms" in out
    assert "prefill 1 -> 2" in out  # explain: the pinned decision
    assert "mode: auto" in out
    assert "error: INVALID_ARGUMENT: prefill: 0 is outside [1, 8]" in err
    assert "cannot reach the controller" in err
