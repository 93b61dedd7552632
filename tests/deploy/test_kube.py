"""`helm install` of deploy/helm/tandem into a real kube-apiserver 1.20.2, then the
controller's ServiceAccount (a TokenRequest token) against RBAC: it can read and patch the
scale of the two worker Deployments and nothing else. No pods run (no kubelet)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.deploy.helm import CHART, GPU_VALUES, Helm
from tests.deploy.kube import KubeCluster

NAMESPACE, OTHER_NAMESPACE, RELEASE = "serving", "elsewhere", "tandem"
PREFILL, DECODE, ROUTER = "tandem-prefill", "tandem-decode", "tandem-router"
CONTROLLER = "tandem-controller"
IMAGE_FLAGS = ["--set", "image.repository=registry.invalid/tandem", "--set", "image.tag=test"]


class Installed:
    def __init__(self, kube: KubeCluster, helm: Helm) -> None:
        self.kube = kube
        self.helm = helm
        self.flags = ["--kubeconfig", str(kube.admin_kubeconfig), "--namespace", NAMESPACE]
        self.install_output = ""
        self.present = False

    def install(self) -> None:
        proc = self.helm.run(
            "install", RELEASE, str(CHART), *self.flags, "--create-namespace", *IMAGE_FLAGS
        )
        self.install_output = proc.stdout
        self.present = True

    def uninstall(self) -> None:
        if self.present:
            self.helm.run("uninstall", RELEASE, *self.flags)
            self.present = False


@pytest.fixture(scope="module")
def installed(kube: KubeCluster, helm: Helm) -> Iterator[Installed]:
    release = Installed(kube, helm)
    release.install()
    try:
        yield release
    finally:
        release.uninstall()


@pytest.fixture(scope="module")
def admin(kube: KubeCluster) -> Iterator[Any]:
    with kube.api_client() as api:
        yield api


@pytest.fixture(scope="module")
def controller_identity(kube: KubeCluster, installed: Installed) -> Iterator[Any]:
    """An API client authenticated as the chart's controller ServiceAccount."""
    kubeconfig = kube.service_account_kubeconfig(NAMESPACE, CONTROLLER)
    with kube.api_client(kubeconfig) as api:
        yield api


# Any: the client's models make every field Optional, which only adds noise to assertions.
def _apps(api: Any) -> Any:
    return client.AppsV1Api(api)


def _core(api: Any) -> Any:
    return client.CoreV1Api(api)


def _status(call: Callable[[], Any]) -> int:
    try:
        call()
    except client.ApiException as exc:
        return int(exc.status)
    return 200


def test_install_creates_the_release_objects(
    kube: KubeCluster, installed: Installed, admin: Any
) -> None:
    apps, core = _apps(admin), _core(admin)
    rbac: Any = client.RbacAuthorizationV1Api(admin)
    net: Any = client.NetworkingV1Api(admin)

    deployments = {d.metadata.name: d for d in apps.list_namespaced_deployment(NAMESPACE).items}
    assert set(deployments) == {ROUTER, PREFILL, DECODE, CONTROLLER}
    assert deployments[ROUTER].spec.template.spec.containers[0].image == (
        "registry.invalid/tandem:test"
    )
    # The 1.20 API server got exec probes (its kubelets cannot probe gRPC natively).
    probe = deployments[PREFILL].spec.template.spec.containers[0].readiness_probe
    assert probe._exec.command[:3] == ["python", "-m", "services.common.healthcheck"]
    # No replicas in the worker manifests: the API server's default, until the controller acts.
    assert deployments[PREFILL].spec.replicas == 1 and deployments[DECODE].spec.replicas == 1
    assert deployments[ROUTER].spec.replicas == 2
    assert [s.metadata.name for s in apps.list_namespaced_stateful_set(NAMESPACE).items] == [
        "tandem-redis"
    ]

    services = {s.metadata.name: s for s in core.list_namespaced_service(NAMESPACE).items}
    assert set(services) == {ROUTER, CONTROLLER, "tandem-redis"}
    assert [p.port for p in services[CONTROLLER].spec.ports] == [50061, 9090]
    core.read_namespaced_service_account(CONTROLLER, NAMESPACE)
    role = rbac.read_namespaced_role(CONTROLLER, NAMESPACE)
    assert [(r.resources, r.resource_names, r.verbs) for r in role.rules] == [
        (["deployments/scale"], [PREFILL, DECODE], ["get", "patch"])
    ]
    binding = rbac.read_namespaced_role_binding(CONTROLLER, NAMESPACE)
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", CONTROLLER, NAMESPACE)
    ]

    pdbs = kube.get_json(f"/apis/policy/v1beta1/namespaces/{NAMESPACE}/poddisruptionbudgets")
    assert sorted(p["metadata"]["name"] for p in pdbs["items"]) == sorted([ROUTER, PREFILL, DECODE])
    assert pdbs["apiVersion"] == "policy/v1beta1"
    policies = net.list_namespaced_network_policy(NAMESPACE).items
    assert sorted(p.metadata.name for p in policies) == sorted(
        [ROUTER, "tandem-workers", CONTROLLER, "tandem-redis"]
    )


def test_install_prints_how_to_reach_the_router_and_controller(installed: Installed) -> None:
    notes = installed.install_output
    assert f"kubectl -n {NAMESPACE} port-forward svc/{ROUTER} 50051:50051" in notes
    assert "tandem.v1.Router/Generate" in notes
    assert f"port-forward svc/{CONTROLLER} 50061:50061" in notes
    assert "tandem ctl --address 127.0.0.1:50061" in notes


def test_controller_scales_the_worker_deployments(admin: Any, controller_identity: Any) -> None:
    apps_as_controller, apps_as_admin = _apps(controller_identity), _apps(admin)
    for name, replicas in ((PREFILL, 3), (DECODE, 2)):
        scale = apps_as_controller.read_namespaced_deployment_scale(name, NAMESPACE)
        assert scale.spec.replicas == 1
        patched = apps_as_controller.patch_namespaced_deployment_scale(
            name, NAMESPACE, {"spec": {"replicas": replicas}}
        )
        assert patched.spec.replicas == replicas
        assert apps_as_admin.read_namespaced_deployment(name, NAMESPACE).spec.replicas == replicas


def test_controller_may_do_nothing_else(admin: Any, controller_identity: Any) -> None:
    apps, core = _apps(controller_identity), _core(controller_identity)
    # A Deployment of the same name in another namespace, so a 403 there is RBAC, not a 404.
    admin_apps, admin_core = _apps(admin), _core(admin)
    admin_core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=OTHER_NAMESPACE))
    )
    admin_apps.create_namespaced_deployment(OTHER_NAMESPACE, _deployment(PREFILL))
    scale_up = {"spec": {"replicas": 5}}

    forbidden: dict[str, Callable[[], Any]] = {
        "read another Deployment's scale": lambda: apps.read_namespaced_deployment_scale(
            ROUTER, NAMESPACE
        ),
        "patch another Deployment's scale": lambda: apps.patch_namespaced_deployment_scale(
            ROUTER, NAMESPACE, scale_up
        ),
        "replace (update) a worker scale": lambda: apps.replace_namespaced_deployment_scale(
            PREFILL,
            NAMESPACE,
            client.V1Scale(
                metadata=client.V1ObjectMeta(name=PREFILL, namespace=NAMESPACE),
                spec=client.V1ScaleSpec(replicas=4),
            ),
        ),
        "get the Deployment itself": lambda: apps.read_namespaced_deployment(PREFILL, NAMESPACE),
        "patch the Deployment itself": lambda: apps.patch_namespaced_deployment(
            PREFILL, NAMESPACE, scale_up
        ),
        "list Deployments": lambda: apps.list_namespaced_deployment(NAMESPACE),
        "delete a worker Deployment": lambda: apps.delete_namespaced_deployment(PREFILL, NAMESPACE),
        "list pods": lambda: core.list_namespaced_pod(NAMESPACE),
        "read a secret": lambda: core.read_namespaced_secret("anything", NAMESPACE),
        "list secrets": lambda: core.list_namespaced_secret(NAMESPACE),
        "read scale in another namespace": lambda: apps.read_namespaced_deployment_scale(
            PREFILL, OTHER_NAMESPACE
        ),
        "patch scale in another namespace": lambda: apps.patch_namespaced_deployment_scale(
            PREFILL, OTHER_NAMESPACE, scale_up
        ),
    }
    statuses = {what: _status(call) for what, call in forbidden.items()}
    assert statuses == dict.fromkeys(forbidden, 403)
    # Nothing above changed anything.
    assert admin_apps.read_namespaced_deployment(PREFILL, OTHER_NAMESPACE).spec.replicas == 1
    assert admin_apps.read_namespaced_deployment(ROUTER, NAMESPACE).spec.replicas == 2
    admin_core.delete_namespace(OTHER_NAMESPACE)


def test_upgrade_keeps_the_controllers_worker_counts(
    installed: Installed, admin: Any, controller_identity: Any
) -> None:
    apps = _apps(admin)
    _apps(controller_identity).patch_namespaced_deployment_scale(
        DECODE, NAMESPACE, {"spec": {"replicas": 4}}
    )
    installed.helm.run(
        "upgrade", RELEASE, str(CHART), *installed.flags, *IMAGE_FLAGS,
        "--set", "router.replicas=3",
    )  # fmt: skip
    assert apps.read_namespaced_deployment(DECODE, NAMESPACE).spec.replicas == 4
    assert apps.read_namespaced_deployment(ROUTER, NAMESPACE).spec.replicas == 3


def test_uninstall_removes_the_release(
    installed: Installed, admin: Any, controller_identity: Any
) -> None:
    installed.uninstall()
    apps = _apps(admin)
    assert apps.list_namespaced_deployment(NAMESPACE).items == []
    assert client.RbacAuthorizationV1Api(admin).list_namespaced_role(NAMESPACE).items == []
    # The ServiceAccount and its Role are gone: its token can do nothing any more (401 once
    # the API server's token cache forgets it, 403 until then).
    assert (
        _status(lambda: _core(admin).read_namespaced_service_account(CONTROLLER, NAMESPACE)) == 404
    )
    as_controller = _apps(controller_identity)
    status = _status(lambda: as_controller.read_namespaced_deployment_scale(PREFILL, NAMESPACE))
    assert status in (401, 403)


def test_gpu_values_are_accepted(kube: KubeCluster, helm: Helm, admin: Any) -> None:
    """The API server's own validation of the GPU render (extended resources, capabilities,
    memory-backed /dev/shm) in a namespace of its own."""
    flags = ["--kubeconfig", str(kube.admin_kubeconfig), "--namespace", "gpu"]
    helm.run("install", "gpu", str(CHART), *flags, "--create-namespace", "-f", str(GPU_VALUES))
    try:
        decode = _apps(admin).read_namespaced_deployment("gpu-tandem-decode", "gpu")
        (container,) = decode.spec.template.spec.containers
        assert container.resources.limits["nvidia.com/gpu"] == "1"
    finally:
        helm.run("uninstall", "gpu", *flags)


def _deployment(name: str) -> client.V1Deployment:
    labels = {"app": name}
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            replicas=1,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="x")]),
            ),
        ),
    )
