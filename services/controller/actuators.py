"""How the controller's decisions reach the cluster.

An actuator reports the replica counts currently asked for (`current`), how many of those
are up and serving (`ready`), the most workers its host holds (`capacity`, local only), and
asks for new counts (`scale`); they raise ActuatorError with a message an operator can act
on. A worker registers in Redis only once it is warmed up, so the live heartbeats never
count one still loading; Kubernetes adds the Deployment's readyReplicas, so that a pod
that cannot be scheduled (Pending) is not counted as added. Scale-down is graceful
everywhere: a worker asked to go gets SIGTERM and drains its requests first (in Kubernetes
through the pod's termination grace period).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from tandem.control import HostCapacity
from tandem.services.controller.host import HostMeter
from tandem.types import Role

log = logging.getLogger(__name__)


class ActuatorError(Exception):
    """The cluster could not be read or changed; the controller retries on its next tick."""


class Actuator(Protocol):
    name: str

    async def current(self, live: Mapping[str, int]) -> dict[str, int]:
        """Replicas per role as last asked for; `live` is how many workers heartbeat now."""
        ...

    async def ready(self, live: Mapping[str, int]) -> dict[str, int]:
        """Workers per role up and serving: never more than `live` (heartbeating, so warmed
        up), fewer where the cluster knows some of those are not ready."""
        ...

    async def capacity(self) -> HostCapacity | None:
        """The most workers the host holds; None where the actuator knows no such limit."""
        ...

    async def scale(self, target: Mapping[str, int]) -> None: ...


def _live(live: Mapping[str, int]) -> dict[str, int]:
    return {role: live.get(role, 0) for role in Role}


class NoActuator:
    """Decide and report only (`--actuator none`): remembers its 'replicas', starting from
    the live worker counts, so decisions read as they would if applied."""

    name = "none"

    def __init__(self) -> None:
        self._replicas: dict[str, int] | None = None

    async def current(self, live: Mapping[str, int]) -> dict[str, int]:
        if self._replicas is None:
            self._replicas = {role: live.get(role, 0) for role in Role}
        return dict(self._replicas)

    async def ready(self, live: Mapping[str, int]) -> dict[str, int]:
        return _live(live)

    async def capacity(self) -> HostCapacity | None:
        return None

    async def scale(self, target: Mapping[str, int]) -> None:
        self._replicas = dict(target)


class KubernetesActuator:
    """Scales the prefill and decode Deployments through their scale subresource.

    Needs `get` and `patch` on `deployments/scale` for those two names (the Helm chart's
    Role). Each patch carries the resourceVersion it was computed from, so a concurrent change
    (an operator's `kubectl scale`, another controller) is a 409 Conflict: the actuator re-reads
    and retries, logging that it overrode someone.

    Ready workers: the Deployment's status.readyReplicas (`get` on `deployments/status`),
    never more than the workers heartbeating. Without that permission (403) it warns once and
    counts the heartbeats alone, which a Pending pod never sends either.
    """

    name = "kubernetes"

    def __init__(
        self, namespace: str, deployments: Mapping[str, str], kubeconfig: str = ""
    ) -> None:
        from kubernetes import client
        from kubernetes import config as kube_config

        if kubeconfig:
            api = kube_config.new_client_from_config(config_file=kubeconfig)
        else:
            kube_config.load_incluster_config()
            api = client.ApiClient()
        self._apps = client.AppsV1Api(api)
        self._namespace = namespace
        self._deployments = dict(deployments)
        self._status_readable = True  # False after a 403 on deployments/status

    async def current(self, live: Mapping[str, int]) -> dict[str, int]:
        return {role: (await asyncio.to_thread(self._read, role))[0] for role in Role}

    async def ready(self, live: Mapping[str, int]) -> dict[str, int]:
        found = _live(live)
        for role in Role:
            ready = await asyncio.to_thread(self._ready_replicas, role)
            if ready is not None:
                found[role] = min(found[role], ready)
        return found

    async def capacity(self) -> HostCapacity | None:
        return None  # the scheduler places pods on nodes; Pending ones are not ready

    def _ready_replicas(self, role: str) -> int | None:
        """status.readyReplicas of a role's Deployment; None when the controller may not
        read it (warned once)."""
        from kubernetes.client.exceptions import ApiException

        if not self._status_readable:
            return None
        name = self._deployments[role]
        try:
            deployment = self._apps.read_namespaced_deployment_status(name, self._namespace)
        except ApiException as exc:
            if exc.status != 403:
                raise ActuatorError(self._describe(exc, "read", role, "status")) from None
            self._status_readable = False
            log.warning(
                "cannot read deployments/%s/status (403): counting heartbeating workers as "
                "ready; grant the controller get on deployments/status to count ready pods",
                name,
            )
            return None
        except Exception as exc:
            raise ActuatorError(f"kubernetes: read deployments/{name}/status: {exc}") from None
        status = deployment.status
        return int(status.ready_replicas or 0) if status is not None else 0

    async def scale(self, target: Mapping[str, int]) -> None:
        for role in Role:
            await asyncio.to_thread(self._scale_one, role, target[role])

    def _read(self, role: str) -> tuple[int, str]:
        """(spec.replicas, resourceVersion) of a role's Deployment."""
        scale = self._call(role, "read", self._apps.read_namespaced_deployment_scale)
        return scale.spec.replicas or 0, scale.metadata.resource_version

    def _scale_one(self, role: str, replicas: int, attempts: int = 5) -> None:
        from kubernetes.client.exceptions import ApiException

        name = self._deployments[role]
        for _ in range(attempts):
            have, version = self._read(role)
            if have == replicas:
                return
            body = {"metadata": {"resourceVersion": version}, "spec": {"replicas": replicas}}
            try:
                self._apps.patch_namespaced_deployment_scale(name, self._namespace, body)
            except ApiException as exc:
                if exc.status == 409:
                    log.warning("deployment %s changed under us (409); re-reading", name)
                    continue
                raise ActuatorError(self._describe(exc, "patch", role)) from None
            except Exception as exc:  # connection refused, TLS, timeouts
                raise ActuatorError(f"kubernetes: patch deployments/{name}/scale: {exc}") from None
            log.info("deployment %s/%s scaled %d -> %d", self._namespace, name, have, replicas)
            return
        raise ActuatorError(
            f"kubernetes: deployments/{name}/scale kept changing ({attempts} conflicts in a "
            "row); is another controller scaling it?"
        )

    def _call(self, role: str, verb: str, fn: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        name = self._deployments[role]
        try:
            return fn(name, self._namespace)
        except ApiException as exc:
            raise ActuatorError(self._describe(exc, verb, role)) from None
        except Exception as exc:
            raise ActuatorError(f"kubernetes: {verb} deployments/{name}/scale: {exc}") from None

    def _describe(self, exc: Any, verb: str, role: str, subresource: str = "scale") -> str:
        name = self._deployments[role]
        hint = {
            403: "the controller's ServiceAccount needs get/patch on deployments/scale",
            404: f"no Deployment {name!r} in namespace {self._namespace!r}",
        }.get(exc.status, "")
        return (
            f"kubernetes: {verb} deployments/{name}/{subresource} in {self._namespace}: "
            f"{exc.status} {exc.reason}" + (f" ({hint})" if hint else "")
        )


class ProcessPool(Protocol):
    """What `tandem up --autoscale` offers the local actuator."""

    def count(self, role: str) -> int:
        """Workers of `role` asked for: running, starting or being restarted, not those told
        to drain. A starting worker counts, so it is not added again."""
        ...

    def worker_pids(self) -> list[int]:
        """Every worker process running now, of both roles: starting and draining ones
        included (they hold cores and memory too)."""
        ...

    def add_worker(self, role: str) -> None: ...

    def remove_worker(self, role: str) -> None: ...


class LocalActuator:
    """Starts and stops worker processes of a `tandem up --autoscale` cluster, within what
    the host holds (`capacity`: tandem.control.capacity, measured by `HostMeter`)."""

    name = "local"

    def __init__(self, pool: ProcessPool, meter: HostMeter | None = None) -> None:
        self._pool = pool
        self._meter = meter or HostMeter()

    async def current(self, live: Mapping[str, int]) -> dict[str, int]:
        return {role: self._pool.count(role) for role in Role}

    async def ready(self, live: Mapping[str, int]) -> dict[str, int]:
        # A heartbeat may outlive a crashed worker by the registry's TTL: never more than run.
        return {role: min(live.get(role, 0), self._pool.count(role)) for role in Role}

    async def capacity(self) -> HostCapacity | None:
        return await asyncio.to_thread(self.measure)

    def measure(self) -> HostCapacity:
        """The host's capacity now (also for `tandem up`'s log at start)."""
        return self._meter.measure(self._pool.worker_pids())

    async def scale(self, target: Mapping[str, int]) -> None:
        for role in Role:
            have = self._pool.count(role)
            for _ in range(target[role] - have):
                await asyncio.to_thread(self._pool.add_worker, role)
            for _ in range(have - target[role]):
                await asyncio.to_thread(self._pool.remove_worker, role)
