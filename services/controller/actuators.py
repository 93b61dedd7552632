"""How the controller's decisions reach the cluster.

An actuator reports the replica counts currently asked for (`current`) and asks for new ones
(`scale`); both raise ActuatorError with a message an operator can act on. Scale-down is
graceful everywhere: a worker asked to go gets SIGTERM and drains its requests first (in
Kubernetes through the pod's termination grace period).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from tandem.control import ROLES

log = logging.getLogger(__name__)


class ActuatorError(Exception):
    """The cluster could not be read or changed; the controller retries on its next tick."""


class Actuator(Protocol):
    name: str

    async def current(self, live: Mapping[str, int]) -> dict[str, int]:
        """Replicas per role as last asked for; `live` is how many workers heartbeat now."""
        ...

    async def scale(self, target: Mapping[str, int]) -> None: ...


class NoActuator:
    """Decide and report only (`--actuator none`): remembers its 'replicas', starting from
    the live worker counts, so decisions read as they would if applied."""

    name = "none"

    def __init__(self) -> None:
        self._replicas: dict[str, int] | None = None

    async def current(self, live: Mapping[str, int]) -> dict[str, int]:
        if self._replicas is None:
            self._replicas = {role: live.get(role, 0) for role in ROLES}
        return dict(self._replicas)

    async def scale(self, target: Mapping[str, int]) -> None:
        self._replicas = dict(target)


class KubernetesActuator:
    """Scales the prefill and decode Deployments through their scale subresource.

    Needs only `get` and `patch` on `deployments/scale` for those two names (the Helm chart's
    Role). Each patch carries the resourceVersion it was computed from, so a concurrent change
    (an operator's `kubectl scale`, another controller) is a 409 Conflict: the actuator re-reads
    and retries, logging that it overrode someone.
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

    async def current(self, live: Mapping[str, int]) -> dict[str, int]:
        return {role: (await asyncio.to_thread(self._read, role))[0] for role in ROLES}

    async def scale(self, target: Mapping[str, int]) -> None:
        for role in ROLES:
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

    def _describe(self, exc: Any, verb: str, role: str) -> str:
        name = self._deployments[role]
        hint = {
            403: "the controller's ServiceAccount needs get/patch on deployments/scale",
            404: f"no Deployment {name!r} in namespace {self._namespace!r}",
        }.get(exc.status, "")
        return (
            f"kubernetes: {verb} deployments/{name}/scale in {self._namespace}: "
            f"{exc.status} {exc.reason}" + (f" ({hint})" if hint else "")
        )


class ProcessPool(Protocol):
    """What `tandem up --autoscale` offers the local actuator."""

    def count(self, role: str) -> int: ...

    def add_worker(self, role: str) -> None: ...

    def remove_worker(self, role: str) -> None: ...


class LocalActuator:
    """Starts and stops worker processes of a `tandem up --autoscale` cluster."""

    name = "local"

    def __init__(self, pool: ProcessPool) -> None:
        self._pool = pool

    async def current(self, live: Mapping[str, int]) -> dict[str, int]:
        return {role: self._pool.count(role) for role in ROLES}

    async def scale(self, target: Mapping[str, int]) -> None:
        for role in ROLES:
            have = self._pool.count(role)
            for _ in range(target[role] - have):
                await asyncio.to_thread(self._pool.add_worker, role)
            for _ in range(have - target[role]):
                await asyncio.to_thread(self._pool.remove_worker, role)
