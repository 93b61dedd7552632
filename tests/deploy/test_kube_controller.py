"""The ratio controller in Kubernetes: `helm install` the chart on a real API server, run the
controller process authenticated as the chart's ServiceAccount, feed a metrics scenario
through a real Redis (worker heartbeats + router timings), and watch it scale the prefill and
then the decode Deployment. Then the same controller under an identity without the chart's
Role: the 403 shows up in its status, and nothing changes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.control import RequestSample
from tandem.services.common.redis.registry import Registry, WorkerInfo
from tandem.services.common.redis.request_log import RequestLog
from tandem.services.common.redis.server import RedisServer
from tandem.v1 import admin_pb2 as apb
from tandem.v1 import admin_pb2_grpc as agrpc
from tests.deploy.helm import Helm
from tests.deploy.kube import KubeCluster

NS = "tandem-ctl"
MODEL = "tandem-tiny-small"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def release(helm: Helm, kube: KubeCluster) -> Iterator[str]:
    from kubernetes import client

    with kube.api_client() as api:
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata={"name": NS}))
    helm.run(
        "install", "tandem", str(ROOT / "deploy/helm/tandem"), "--namespace", NS,
        "--kubeconfig", str(kube.admin_kubeconfig), "--set", "image.repository=tandem-test",
    )  # fmt: skip
    yield "tandem"
    helm.run("uninstall", "tandem", "--namespace", NS, "--kubeconfig", str(kube.admin_kubeconfig))


def replicas(kube: KubeCluster, name: str) -> int:
    from kubernetes import client

    with kube.api_client() as api:
        scale = client.AppsV1Api(api).read_namespaced_deployment_scale(name, NS)
    return int(scale.spec.replicas)


def pods_ready(kube: KubeCluster, name: str) -> None:
    """Play the kubelet and the Deployment controller (this cluster runs neither): report as
    many ready replicas as the Deployment asks for. The controller scales a role only while
    all its workers are ready, so without this it would (rightly) wait forever."""
    from kubernetes import client

    want = replicas(kube, name)
    with kube.api_client() as api:
        client.AppsV1Api(api).patch_namespaced_deployment_status(
            name, NS, {"status": {"replicas": want, "readyReplicas": want,
                                  "availableReplicas": want}}
        )  # fmt: skip


def wait_for(what: str, cond: Callable[[], bool], proc: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"waiting for {what}; controller log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def start_controller(
    kubeconfig: Path, redis_url: str, log: Path
) -> tuple[subprocess.Popen[str], str]:
    argv = [
        sys.executable, "-m", "tandem.services.controller", "--actuator", "kubernetes",
        "--kubeconfig", str(kubeconfig), "--namespace", NS,
        "--prefill-deployment", "tandem-prefill", "--decode-deployment", "tandem-decode",
        "--redis-url", redis_url, "--model-id", MODEL, "--port", "0", "--metrics-port", "0",
        "--interval-s", "0.5", "--window-s", "5", "--min-requests", "5",
        "--scale-up-cooldown-s", "0", "--max-prefill", "4", "--max-decode", "4",
        "--ttft-p90-ms", "500", "--itl-p90-ms", "100",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,  # noqa: SIM115
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY controller "):
        proc.kill()
        pytest.fail(f"controller did not start: {line!r}\n{log.read_text()[-3000:]}")
    return proc, line.split()[-1]


async def heartbeat(
    redis_url: str, workers: list[WorkerInfo], timings: list[RequestSample]
) -> None:
    registry = Registry(redis_url, ttl_s=120)
    for w in workers:
        await registry.register(w)
    await registry.close()
    log = RequestLog(redis_url, MODEL)
    for t in timings:
        log.record(t)
    await log.stop()


def worker(worker_id: str, role: str, **stats: object) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id, role=role, address=f"{worker_id}:1", model=MODEL, epoch=1,
        num_blocks=4096, num_free_blocks=4000, **stats,  # type: ignore[arg-type]
    )  # fmt: skip


def test_controller_scales_the_deployments_as_the_charts_service_account(
    kube: KubeCluster, release: str, tmp_path: Path
) -> None:
    sa_kubeconfig = kube.service_account_kubeconfig(NS, f"{release}-controller")
    assert (replicas(kube, "tandem-prefill"), replicas(kube, "tandem-decode")) == (1, 1)
    pods_ready(kube, "tandem-prefill")
    pods_ready(kube, "tandem-decode")
    with RedisServer() as redis:
        log = tmp_path / "controller.log"
        proc, address = start_controller(sa_kubeconfig, redis.url, log)
        try:
            # Prefill-bound: the one prefill worker is saturated with a backlog, TTFT misses.
            asyncio.run(
                heartbeat(
                    redis.url,
                    [
                        worker("p0", "prefill", busy_frac=1.0, tokens_per_s=2000.0,
                               step_ms=80.0, queued_prefill_tokens=4000),
                        worker("d0", "decode", busy_frac=1.0, tokens_per_s=100.0,
                               step_ms=20.0, num_running=4),
                    ],
                    [RequestSample(time.time(), 1500.0, 20.0, 1000, 32) for _ in range(10)],
                )
            )  # fmt: skip
            wait_for("prefill to scale up", lambda: replicas(kube, "tandem-prefill") > 1, proc, log)
            assert replicas(kube, "tandem-decode") == 1
            pods_ready(kube, "tandem-prefill")

            # Decode-bound: long batches whose step time breaks the ITL target.
            asyncio.run(
                heartbeat(
                    redis.url,
                    [
                        worker("p0", "prefill", busy_frac=0.1, tokens_per_s=200.0, step_ms=80.0),
                        worker("d0", "decode", busy_frac=1.0, tokens_per_s=500.0,
                               step_ms=130.0, num_running=60),
                        worker("d1", "decode", busy_frac=1.0, tokens_per_s=500.0,
                               step_ms=150.0, num_running=70),
                    ],
                    [RequestSample(time.time(), 200.0, 150.0, 500, 64) for _ in range(10)],
                )
            )  # fmt: skip
            wait_for("decode to scale up", lambda: replicas(kube, "tandem-decode") > 1, proc, log)

            with grpc.insecure_channel(address) as channel:
                stub = agrpc.AdminStub(channel)
                status = stub.Status(apb.StatusRequest())
                decisions = stub.Explain(apb.ExplainRequest(limit=100)).decisions
            assert status.actuator == "kubernetes"
            assert status.last_error == ""
            ups = {
                role: [d for d in decisions if d.target[role] > d.current[role]]
                for role in ("prefill", "decode")
            }
            assert all(d.applied for d in ups["prefill"] + ups["decode"])
            assert ups["prefill"][-1].reasons["prefill"].startswith("scale up 1 -> ")
            assert "ITL p90 150 ms > SLA 100 ms" in ups["decode"][-1].reasons["decode"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def test_controller_without_the_role_reports_403_and_changes_nothing(
    kube: KubeCluster, release: str, tmp_path: Path
) -> None:
    from kubernetes import client

    with kube.api_client() as api:
        client.CoreV1Api(api).create_namespaced_service_account(
            NS, client.V1ServiceAccount(metadata={"name": "nobody"})
        )
    kubeconfig = kube.service_account_kubeconfig(NS, "nobody")
    before = replicas(kube, "tandem-prefill")
    with RedisServer() as redis:
        log = tmp_path / "controller.log"
        proc, address = start_controller(kubeconfig, redis.url, log)
        try:
            with grpc.insecure_channel(address) as channel:
                stub = agrpc.AdminStub(channel)
                wait_for(
                    "a 403 in the status",
                    lambda: "403" in stub.Status(apb.StatusRequest()).last_error,
                    proc,
                    log,
                )
                error = stub.Status(apb.StatusRequest()).last_error
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert "needs get/patch on deployments/scale" in error
    assert replicas(kube, "tandem-prefill") == before


def test_actuator_retries_a_409_from_a_concurrent_scale(
    kube: KubeCluster, release: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The actuator computes its patch from a resourceVersion that an operator's `kubectl
    scale` has made stale: the API server answers 409, the actuator re-reads and wins."""
    from kubernetes import client

    from tandem.services.controller.actuators import KubernetesActuator

    actuator = KubernetesActuator(
        NS, {"prefill": "tandem-prefill", "decode": "tandem-decode"}, str(kube.admin_kubeconfig)
    )
    have, stale_version = actuator._read("decode")
    with kube.api_client() as api:  # the operator scales in between
        client.AppsV1Api(api).patch_namespaced_deployment_scale(
            "tandem-decode", NS, {"spec": {"replicas": have + 1}}
        )
    reads: list[str] = []
    real_read = actuator._read

    def read_stale_first(role: str) -> tuple[int, str]:
        reads.append(role)
        return (have, stale_version) if len(reads) == 1 else real_read(role)

    actuator._read = read_stale_first  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        actuator._scale_one("decode", have + 3)
    assert "changed under us (409)" in caplog.text
    assert len(reads) == 2
    assert replicas(kube, "tandem-decode") == have + 3
