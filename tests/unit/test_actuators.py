"""The actuators' view of readiness and capacity, on in-memory stand-ins: the local
actuator counts a starting worker as asked for (never added twice) but not as serving; the
Kubernetes actuator counts a Pending pod as not ready (readyReplicas), and without the
permission to read it falls back to the heartbeats."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tandem.control import host_capacity
from tandem.services.controller.actuators import ActuatorError, KubernetesActuator, LocalActuator
from tandem.services.controller.host import HostMeter

GIB = 1 << 30


class Pool:
    """A ProcessPool of named workers, each with a pid; `starting` ones have not warmed up."""

    def __init__(self) -> None:
        self.workers: dict[str, list[int]] = {"prefill": [11], "decode": [12]}
        self.added: list[str] = []

    def count(self, role: str) -> int:
        return len(self.workers[role])

    def worker_pids(self) -> list[int]:
        return [pid for pids in self.workers.values() for pid in pids]

    def add_worker(self, role: str) -> None:
        self.added.append(role)
        self.workers[role].append(20 + len(self.added))

    def remove_worker(self, role: str) -> None:
        self.workers[role].pop()


def test_local_actuator_counts_a_starting_worker_as_asked_for_not_as_serving(
    tmp_path: Path,
) -> None:
    proc = tmp_path / "proc"
    for pid in (11, 12, 21):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "status").write_text("VmHWM:\t 1048576 kB\n")
    (proc / "meminfo").write_text(f"MemAvailable: {20 * GIB // 1024} kB\n")
    pool = Pool()
    actuator = LocalActuator(pool, HostMeter(cores=4, proc=proc, cgroup=tmp_path / "none"))

    async def body() -> None:
        await actuator.scale({"prefill": 2, "decode": 1})
        assert pool.added == ["prefill"]
        # The new worker is loading: no heartbeat yet. Asked for 2, 1 serves.
        live = {"prefill": 1, "decode": 1}
        assert await actuator.current(live) == {"prefill": 2, "decode": 1}
        assert await actuator.ready(live) == {"prefill": 1, "decode": 1}
        await actuator.scale({"prefill": 2, "decode": 1})  # the same target: nothing added
        assert pool.added == ["prefill"]
        # A heartbeat that outlives its worker (registry TTL) is not counted.
        assert await actuator.ready({"prefill": 3, "decode": 1}) == {"prefill": 2, "decode": 1}
        assert await actuator.capacity() == host_capacity(4, 20 * GIB, GIB, 3)

    asyncio.run(body())


class Apps:
    """The two calls of AppsV1Api the actuator makes, on in-memory Deployments."""

    def __init__(self, spec: dict[str, int], ready: dict[str, int | None]) -> None:
        self.spec, self.ready = spec, ready
        self.status_error: ApiException | None = None
        self.status_reads = 0

    def read_namespaced_deployment_scale(self, name: str, namespace: str) -> Any:
        return SimpleNamespace(
            spec=SimpleNamespace(replicas=self.spec[name]),
            metadata=SimpleNamespace(resource_version="1"),
        )

    def read_namespaced_deployment_status(self, name: str, namespace: str) -> Any:
        self.status_reads += 1
        if self.status_error is not None:
            raise self.status_error
        return SimpleNamespace(status=SimpleNamespace(ready_replicas=self.ready[name]))


def kube_actuator(apps: Apps) -> KubernetesActuator:
    actuator = KubernetesActuator.__new__(KubernetesActuator)  # no cluster config to load
    actuator._apps = apps  # type: ignore[assignment]
    actuator._namespace = "serving"
    actuator._deployments = {"prefill": "p", "decode": "d"}
    actuator._status_readable = True
    return actuator


def test_kubernetes_pending_pods_are_not_ready(caplog: pytest.LogCaptureFixture) -> None:
    # Scaled to 3 prefill pods: 1 ready, 2 Pending (readyReplicas 1); decode has no ready
    # pod reported yet (readyReplicas unset).
    apps = Apps({"p": 3, "d": 1}, {"p": 1, "d": None})
    actuator = kube_actuator(apps)
    live = {"prefill": 1, "decode": 1}

    async def body() -> None:
        assert await actuator.current(live) == {"prefill": 3, "decode": 1}
        assert await actuator.ready(live) == {"prefill": 1, "decode": 0}
        # Ready pods that do not heartbeat yet (a TCP probe passes before warm-up): the
        # heartbeats bound it.
        apps.ready = {"p": 3, "d": 1}
        assert await actuator.ready(live) == {"prefill": 1, "decode": 1}
        assert await actuator.capacity() is None
        # Without get on deployments/status: warned once, the heartbeats alone.
        apps.status_error = ApiException(status=403, reason="Forbidden")
        with caplog.at_level(logging.WARNING):
            assert await actuator.ready({"prefill": 2, "decode": 1}) == {
                "prefill": 2,
                "decode": 1,
            }
            reads = apps.status_reads
            assert await actuator.ready(live) == live
        assert apps.status_reads == reads  # not asked again
        assert caplog.text.count("cannot read deployments/p/status (403)") == 1

    asyncio.run(body())


def test_kubernetes_status_errors_other_than_403_are_actuator_errors() -> None:
    apps = Apps({"p": 1, "d": 1}, {"p": 1, "d": 1})
    apps.status_error = ApiException(status=500, reason="Internal Server Error")
    with pytest.raises(ActuatorError, match="read deployments/p/status in serving: 500"):
        asyncio.run(kube_actuator(apps).ready({"prefill": 1, "decode": 1}))
