"""`tandem up --autoscale`: the ratio controller, with the local actuator, adds a prefill
worker under a prefill-heavy load and removes it (after it drained) once the load is gone.
Real processes, Redis, gRPC and NIXL; the model is the 46M-parameter preset so that prefill
is the bottleneck on this CPU.

The host is declared to have 3 cores (`host_cores`): one worker per core, so the third
worker fits where this machine's 2 cores would hold only the starting two (that clamp, and
the probation of a scale-up, have exact tests in tests/unit and test_controller.py). The
scale-up's probation is longer than the test, so the load's end, not a goodput verdict
on a shared machine, is what brings the count back down."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tandem.client import TandemClient, TandemError
from tandem.services.up import Cluster, UpConfig
from tandem.v1 import admin_pb2 as apb
from tandem.v1 import admin_pb2_grpc as agrpc
from tandem.weights.tiny import make_tiny_model

CONTROLLER_ARGS = (
    "--interval-s", "1", "--window-s", "6", "--min-requests", "3",
    "--scale-up-cooldown-s", "0", "--scale-down-stable-s", "4", "--scale-down-cooldown-s", "4",
    "--max-prefill", "2", "--max-decode", "1", "--ttft-p90-ms", "1000",
    "--scale-up-trial-s", "600",
)  # fmt: skip


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("small"), preset="small")


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float) -> float:
    """Poll `cond` until true; the seconds it took. Fails the test after `timeout_s`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - t0


def test_autoscale_follows_a_prefill_heavy_load(small_model_dir: Path) -> None:
    cluster = Cluster(
        UpConfig(
            model_dir=str(small_model_dir),
            dtype="float32",
            port=0,
            http_port=0,
            num_prefill=1,
            num_decode=1,
            autoscale=True,
            admin_port=0,
            controller_args=CONTROLLER_ARGS,
            host_cores=3,
        )  # fmt: skip
    )
    cluster.start()
    stop = threading.Event()
    errors: list[str] = []
    done = [0]

    def load(seed: int) -> None:
        rng = random.Random(seed)
        with TandemClient(cluster.router_address, timeout_s=60) as client:
            while not stop.is_set():
                prompt = [rng.randrange(5, 8192) for _ in range(600)]  # never a cache hit
                try:
                    client.generate(prompt, max_tokens=2)
                    done[0] += 1
                except TandemError as exc:
                    errors.append(str(exc))

    channel = grpc.insecure_channel(cluster.controller_address)
    admin = agrpc.AdminStub(channel)
    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    try:
        assert cluster.count("prefill") == 1
        for t in threads:
            t.start()
        wait_for("a second prefill worker", lambda: cluster.count("prefill") == 2, 120)
        status = admin.Status(apb.StatusRequest())
        assert [r.desired for r in status.roles] == [2, 1]
        assert status.capacity.max_workers == 3
        assert status.capacity.reason.startswith("3 cores, one worker per core; ")
        # The router's timings reach the controller (the status of one tick may fall in a
        # window with none finished on a loaded machine: wait for one that has some).
        wait_for(
            "the router's timings at the controller",
            lambda: admin.Status(apb.StatusRequest()).window_requests > 0,
            60,
        )
        ups = [
            d for d in admin.Explain(apb.ExplainRequest(limit=100)).decisions
            if d.target["prefill"] > d.current["prefill"]
        ]  # fmt: skip
        assert ups and ups[-1].reasons["prefill"].startswith("scale up 1 -> 2: demand")
        # The new worker registers and takes requests.
        wait_for(
            "the new worker to heartbeat",
            lambda: admin.Status(apb.StatusRequest()).roles[0].live == 2,
            120,
        )
        # Serving now, and the host is full: 3 workers for 3 cores.
        wait_for(
            "the controller to see it serve",
            lambda: admin.Status(apb.StatusRequest()).roles[0].ready == 2,
            30,
        )
        assert admin.Status(apb.StatusRequest()).capacity.num_workers == 3
        served = done[0]
        time.sleep(3)
        assert done[0] > served
    finally:
        stop.set()
        for t in threads:
            t.join()
    try:
        assert errors == []
        # Idle now: after the stable period one worker drains and exits.
        wait_for("prefill back to one worker", lambda: cluster.count("prefill") == 1, 120)
        downs = [
            d for d in admin.Explain(apb.ExplainRequest(limit=100)).decisions
            if d.target["prefill"] < d.current["prefill"]
        ]  # fmt: skip
        assert downs[0].reasons["prefill"].startswith("scale down 2 -> 1")
        wait_for(
            "the drained worker to deregister",
            lambda: admin.Status(apb.StatusRequest()).roles[0].live == 1,
            60,
        )
        # The cluster still serves.
        with TandemClient(cluster.router_address, timeout_s=60) as client:
            assert client.generate([5, 6, 7], max_tokens=3).completion_tokens == 3
    finally:
        channel.close()
        cluster.stop()
    assert cluster.children == []
