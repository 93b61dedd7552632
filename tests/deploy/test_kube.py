"""`helm install` of deploy/helm/tandem into a real kube-apiserver 1.20.2, with its
credentials on (generated API keys, cluster secret, admin keys and Redis password) and TLS
(router TLS and internal mTLS from Secrets made here with openssl), then the controller's
ServiceAccount (a TokenRequest token) against RBAC: it can read and patch the scale of the
two worker Deployments and nothing else. The generated credentials survive `helm upgrade`
(the chart looks them up). No pods run (no kubelet)."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.deploy.helm import CHART, GPU_VALUES, Helm
from tests.deploy.kube import KubeCluster

NAMESPACE, OTHER_NAMESPACE, RELEASE = "serving", "elsewhere", "tandem"
PREFILL, DECODE, ROUTER = "tandem-prefill", "tandem-decode", "tandem-router"
CONTROLLER = "tandem-controller"
IMAGE_FLAGS = ["--set", "image.repository=registry.invalid/tandem", "--set", "image.tag=test"]
ROUTER_TLS, INTERNAL_TLS = "router-tls", "tandem-mtls"
AUTH_FLAGS = [
    "--set", f"auth.tls.secretName={ROUTER_TLS}",
    "--set", f"auth.internalTls.secretName={INTERNAL_TLS}",
]  # fmt: skip
GENERATED = {  # Secret -> its key
    "tandem-api-keys": "api-keys",
    "tandem-cluster-secret": "cluster-secret",
    "tandem-admin-keys": "admin-keys",
    "tandem-redis-password": "redis-password",
}


class Installed:
    def __init__(self, kube: KubeCluster, helm: Helm) -> None:
        self.kube = kube
        self.helm = helm
        self.flags = ["--kubeconfig", str(kube.admin_kubeconfig), "--namespace", NAMESPACE]
        self.install_output = ""
        self.present = False

    def install(self) -> None:
        proc = self.helm.run(
            "install", RELEASE, str(CHART), *self.flags, "--create-namespace", *IMAGE_FLAGS,
            *AUTH_FLAGS,
        )  # fmt: skip
        self.install_output = proc.stdout
        self.present = True

    def uninstall(self) -> None:
        if self.present:
            self.helm.run("uninstall", RELEASE, *self.flags)
            self.present = False


def _tls_secrets(kube: KubeCluster, workdir: Path) -> None:
    """The namespace, a CA, and the two TLS Secrets the release names (as cert-manager
    would write them: tls.crt, tls.key, and ca.crt for the internal one)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=workdir)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
            "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=tandem", "-keyout", "tls.key",
            "-out", "tls.csr")  # fmt: skip
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", "tls.crt")  # fmt: skip

    def data(*names: str) -> dict[str, bytes | str]:
        return {n: base64.b64encode((workdir / n).read_bytes()).decode() for n in names}

    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
        for name, keys, kind in (
            (ROUTER_TLS, ("tls.crt", "tls.key"), "kubernetes.io/tls"),
            (INTERNAL_TLS, ("tls.crt", "tls.key", "ca.crt"), "kubernetes.io/tls"),
        ):
            secret = client.V1Secret(
                metadata=client.V1ObjectMeta(name=name), type=kind, data=data(*keys)
            )
            core.create_namespaced_secret(NAMESPACE, secret)


@pytest.fixture(scope="module")
def installed(
    kube: KubeCluster, helm: Helm, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Installed]:
    _tls_secrets(kube, tmp_path_factory.mktemp("tls"))
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
    # Every gRPC port speaks TLS here: TCP probes (the exec ones: test_gpu_values_...).
    probe = deployments[PREFILL].spec.template.spec.containers[0].readiness_probe
    assert probe.tcp_socket.port == 50052 and probe._exec is None
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
        (["deployments/scale"], [PREFILL, DECODE], ["get", "patch"]),
        (["deployments/status"], [PREFILL, DECODE], ["get"]),
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


def _generated(admin: Any) -> dict[str, str]:
    core = _core(admin)
    return {
        name: base64.b64decode(core.read_namespaced_secret(name, NAMESPACE).data[key]).decode()
        for name, key in GENERATED.items()
    }


def test_install_generates_the_credentials_and_mounts_them(
    installed: Installed, admin: Any
) -> None:
    values = _generated(admin)
    assert values["tandem-api-keys"].split()[1:] == ["default"]
    assert values["tandem-admin-keys"].split()[1:] == ["admin", "admin"]
    assert len(values["tandem-cluster-secret"]) >= 64
    deployments = {
        d.metadata.name: d for d in _apps(admin).list_namespaced_deployment(NAMESPACE).items
    }
    expected = {
        ROUTER: {"api-keys": "tandem-api-keys", "tls": ROUTER_TLS},
        PREFILL: {},
        DECODE: {},
        CONTROLLER: {"admin-keys": "tandem-admin-keys"},
    }
    for name, own in expected.items():
        pod = deployments[name].spec.template.spec
        secrets = {v.name: v.secret.secret_name for v in pod.volumes or [] if v.secret}
        assert secrets == {
            **own, "cluster-secret": "tandem-cluster-secret", "internal-tls": INTERNAL_TLS
        }, name  # fmt: skip
        (container,) = pod.containers
        env = {e.name: e for e in container.env}
        assert (
            env["TANDEM_CLUSTER_SECRET_FILE"].value == "/etc/tandem/cluster-secret/cluster-secret"
        )
        assert env["TANDEM_INTERNAL_CA_FILE"].value == "/etc/tandem/internal-tls/ca.crt"
        assert env["REDIS_PASSWORD"].value_from.secret_key_ref.name == "tandem-redis-password"
        assert "$(REDIS_PASSWORD)@tandem-redis" in env["TANDEM_REDIS_URL"].value
        # TLS ports get TCP probes; no secret value is in the stored manifest.
        assert container.readiness_probe.tcp_socket.port == container.ports[0].container_port
        stored = str(deployments[name].to_dict())
        assert not [v for v in values.values() if v.split()[0] in stored]
    router_env = {e.name: e.value for e in deployments[ROUTER].spec.template.spec.containers[0].env}
    assert router_env["TANDEM_API_KEYS_FILE"] == "/etc/tandem/api-keys/api-keys"
    assert router_env["TANDEM_TLS_CERT_FILE"] == "/etc/tandem/tls/tls.crt"


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
    credentials = _generated(admin)
    installed.helm.run(
        "upgrade", RELEASE, str(CHART), *installed.flags, *IMAGE_FLAGS, *AUTH_FLAGS,
        "--set", "router.replicas=3",
    )  # fmt: skip
    decode = apps.read_namespaced_deployment(DECODE, NAMESPACE)
    assert decode.spec.replicas == 4
    assert apps.read_namespaced_deployment(ROUTER, NAMESPACE).spec.replicas == 3
    # The API server holds the rolling-update settings an upgrade of the workers runs with:
    # the new pod first, the old one then drained within its grace period (issue 46).
    for name in (PREFILL, DECODE):
        spec = apps.read_namespaced_deployment(name, NAMESPACE).spec
        assert spec.strategy.type == "RollingUpdate"
        assert (
            spec.strategy.rolling_update.max_surge,
            spec.strategy.rolling_update.max_unavailable,
        ) == (1, 0)
        assert spec.template.spec.termination_grace_period_seconds == 30 + 15  # drain + margin
    # The generated keys, secret and password are looked up, not made anew: running pods
    # and clients keep working across an upgrade.
    assert _generated(admin) == credentials


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
    memory-backed /dev/shm) in a namespace of its own, with tensor-parallel decode workers
    (two GPUs a pod)."""
    flags = ["--kubeconfig", str(kube.admin_kubeconfig), "--namespace", "gpu"]
    tp = ["--set", "decode.tensorParallelSize=2"]
    helm.run("install", "gpu", str(CHART), *flags, "--create-namespace", "-f", str(GPU_VALUES), *tp)
    try:
        decode = _apps(admin).read_namespaced_deployment("gpu-tandem-decode", "gpu")
        (container,) = decode.spec.template.spec.containers
        assert container.resources.limits["nvidia.com/gpu"] == "2"
        assert container.resources.requests["nvidia.com/gpu"] == "2"
        prefill = _apps(admin).read_namespaced_deployment("gpu-tandem-prefill", "gpu")
        assert prefill.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
        # The 1.20 API server got exec probes (its kubelets cannot probe gRPC natively),
        # through a shell that passes the pod IP the worker listens on.
        command = container.readiness_probe._exec.command
        assert (
            command[:2] == ["sh", "-c"] and "tandem.services.common.rpc.healthcheck" in command[2]
        )
        assert '--host "$TANDEM_HOST"' in command[2]
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
