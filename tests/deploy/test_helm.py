"""deploy/helm/tandem rendered by the real helm 3: lint, Kubernetes schemas, the values
schema against the config dataclasses, RBAC, env, probes and API versions per cluster."""

from __future__ import annotations

import functools
import json
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.flags import Leaf, leaves, parse_config
from services.common.worker.shell import WorkerConfig
from services.controller.config import ControllerConfig
from services.router.config import RouterConfig
from tests.deploy.helm import (
    CHART,
    GPU_VALUES,
    Helm,
    HelmError,
    containers,
    env_of,
    find,
    kubernetes_validate,
    one,
)

# component -> (its config dataclass, the fields the chart sets itself and why).
CONFIGS: dict[str, type] = {
    "router": RouterConfig,
    "prefill": WorkerConfig,
    "decode": WorkerConfig,
    "controller": ControllerConfig,
}
CHART_CONTROLLED: dict[type, dict[str, str]] = {
    RouterConfig: {
        "host": "0.0.0.0",
        "port": "router.port",
        "redis_url": "bundled or external Redis",
        "model_dir": "model.dir",
        "prefill_addresses": "not rendered: workers are found through Redis",
        "decode_addresses": "not rendered: workers are found through Redis",
    },
    WorkerConfig: {
        "host": "0.0.0.0",
        "port": "<role>.port",
        "advertise_host": "the pod IP",
        "worker_id": "the pod name",
        "redis_url": "bundled or external Redis",
        "model_dir": "model.dir",
        "role": "not rendered: the service's own (python -m services.<role>)",
    },
    ControllerConfig: {
        "host": "0.0.0.0",
        "port": "controller.port",
        "metrics_port": "controller.metricsPort",
        "redis_url": "bundled or external Redis",
        "namespace": "the release namespace",
        "prefill_deployment": "the chart's prefill Deployment",
        "decode_deployment": "the chart's decode Deployment",
        "kubeconfig": "empty: in-cluster credentials",
    },
}
NOT_RENDERED = {"prefill_addresses", "decode_addresses", "role"}
# Fields the program sets itself (no flag, no env): see services.common.worker.shell.run_worker.
FIXED: dict[type, dict[str, str]] = {WorkerConfig: {"role": "prefill"}}


def _leaves(cls: type) -> dict[str, Leaf]:
    """The settable leaf fields of a (nested) config: flag, env and Helm key names."""
    return {leaf.name: leaf for leaf in leaves(cls) if leaf.name not in FIXED.get(cls, {})}


def _get(obj: Any, leaf: Leaf) -> Any:
    return functools.reduce(getattr, leaf.path, obj)


# Non-default values for the round trip values -> env -> parse_config (large integers and
# fractions are where YAML -> Go -> env text goes wrong).
NON_DEFAULTS: dict[str, dict[str, Any]] = {
    "router": {
        "max_inflight": 7,
        "policy": "load",
        "index_timeout_s": 0.025,
        "model_id": "m",
        "min_free_block_fraction": 0.125,
    },
    "prefill": {
        "kv_cache_bytes": 4294967296,
        "num_threads": 4,
        "lease_ttl_s": 2.5,
        "dtype": "bfloat16",
        "long_prefill_token_threshold": 512,
    },
    "decode": {
        "kv_cache_bytes": 12884901888,
        "transport": "local",
        "drain_timeout_s": 100.5,
        "enable_prefix_caching": False,
        "device": "cpu",
    },
    "controller": {"target_utilization": 0.55, "max_decode": 12, "actuator": "none"},
}
RELEASE, NAMESPACE = "tandem", "tandem"


def _name(component: str, release: str = RELEASE) -> str:
    return f"{release}-{component}" if "tandem" in release else f"{release}-tandem-{component}"


def _component(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["labels"]["app.kubernetes.io/component"])


def _workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def _pod(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The pod spec of a component's Deployment."""
    return dict(one(objects, "Deployment", _name(component))["spec"]["template"]["spec"])


def _values(tmp_path: Path, values: dict[str, Any]) -> list[str]:
    """`-f FILE` flags for a values file holding `values`."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def _schema() -> dict[str, Any]:
    return dict(json.loads((CHART / "values.schema.json").read_text()))


def _json_type(tp: Any) -> str | list[str]:
    args = typing.get_args(tp)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return [str(_json_type(inner)), "null"]
    return {int: "integer", float: "number", str: "string", bool: "boolean"}[tp]


# -- lint and Kubernetes schemas -------------------------------------------------------------


@pytest.mark.parametrize("values", [[], ["-f", str(GPU_VALUES)]], ids=["default", "gpu"])
def test_lint_strict(helm: Helm, values: list[str]) -> None:
    proc = helm.run("lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("values", [[], ["-f", str(GPU_VALUES)]], ids=["default", "gpu"])
def test_render_passes_kubernetes_validate(helm: Helm, values: list[str]) -> None:
    manifest = helm.template(*values)
    proc = kubernetes_validate(manifest, "1.30")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARN" not in proc.stdout + proc.stderr  # every kind had a schema to check against
    assert proc.stdout.count("passed for resource") == len(list(yaml.safe_load_all(manifest)))


def test_kube_1_20_render_passes_kubernetes_validate(helm: Helm) -> None:
    # kubernetes-validate's oldest schemas are 1.25, which has no policy/v1beta1: the 1.20
    # PDBs are checked by the 1.20 API server in test_kube.py instead.
    objects = helm.render("--kube-version", "1.20.2")
    rest = [o for o in objects if o["kind"] != "PodDisruptionBudget"]
    proc = kubernetes_validate(yaml.safe_dump_all(rest), "1.25")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARN" not in proc.stdout + proc.stderr


# -- API versions and probes per cluster version ---------------------------------------------


@pytest.mark.parametrize(
    ("kube_version", "pdb_api", "native_grpc"),
    [
        ("1.20.2", "policy/v1beta1", False),
        ("1.23.5", "policy/v1", False),
        ("1.24.0", "policy/v1", True),
        (None, "policy/v1", True),  # helm's default
    ],
)
def test_pdb_version_and_probe_kind_follow_the_cluster(
    helm: Helm, kube_version: str | None, pdb_api: str, native_grpc: bool
) -> None:
    objects = helm.render(*(["--kube-version", kube_version] if kube_version else []))
    pdbs = find(objects, "PodDisruptionBudget")
    assert sorted(p["metadata"]["name"] for p in pdbs) == sorted(
        _name(c) for c in ("router", "prefill", "decode")
    )
    assert {p["apiVersion"] for p in pdbs} == {pdb_api}
    for pdb in pdbs:
        deployment = one(objects, "Deployment", pdb["metadata"]["name"])
        assert pdb["spec"]["selector"] == deployment["spec"]["selector"]

    probed = [o for o in _workloads(objects) if _component(o) != "redis"]
    assert sorted(_component(o) for o in probed) == ["controller", "decode", "prefill", "router"]
    for workload in probed:
        (container,) = containers(workload)
        port = container["ports"][0]["containerPort"]
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = container[kind]
            if native_grpc:
                assert probe["grpc"] == {"port": port}
                assert "exec" not in probe
            else:
                command = probe["exec"]["command"]
                assert command[:5] == [
                    "python",
                    "-m",
                    "services.common.healthcheck",
                    "--port",
                    str(port),
                ]
                assert float(command[command.index("--timeout-s") + 1]) < probe["timeoutSeconds"]
                assert "grpc" not in probe


def test_a_component_startup_probe_overrides_the_shared_one(helm: Helm) -> None:
    """A GPU worker loads weights and warms up for minutes before it reports SERVING: its
    startup budget is set per role, the other keys come from probes.startup."""
    objects = helm.render("--set", "prefill.startupProbe.failureThreshold=360")
    budgets = {}
    for component in ("prefill", "decode", "router"):
        (container,) = containers(one(objects, "Deployment", _name(component)))
        probe = container["startupProbe"]
        budgets[component] = (probe["periodSeconds"], probe["failureThreshold"])
    assert budgets == {"prefill": (5, 360), "decode": (5, 120), "router": (5, 120)}
    with pytest.raises(HelmError):
        helm.render("--set", "decode.startupProbe.failureTreshold=3")  # a typo is refused


# -- image ---------------------------------------------------------------------------------------


def _tandem_images(objects: list[dict[str, Any]]) -> set[str]:
    """The images of every container (init containers included) outside Redis."""
    images = set()
    for workload in _workloads(objects):
        if _component(workload) == "redis":
            continue
        pod = workload["spec"]["template"]["spec"]
        images |= {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    return images


@pytest.mark.parametrize(
    ("flags", "image"),
    [
        ([], "localhost/tandem:0.1.0-cpu"),  # `make image` (VARIANT=cpu)
        (["-f", str(GPU_VALUES)], "localhost/tandem:0.1.0-cuda"),  # `make image VARIANT=cuda`
        (["--set", "image.variant=cuda"], "localhost/tandem:0.1.0-cuda"),
        (
            ["--set", "image.repository=registry.example.com/tandem"],
            "registry.example.com/tandem:0.1.0-cpu",
        ),
        # An explicit tag is used as is: no variant suffix.
        (["-f", str(GPU_VALUES), "--set", "image.tag=nightly"], "localhost/tandem:nightly"),
    ],
    ids=["default", "gpu", "variant", "repository", "tag"],
)
def test_image_is_the_make_image_name(helm: Helm, flags: list[str], image: str) -> None:
    assert _tandem_images(helm.render(*flags)) == {image}


def test_app_version_is_the_package_version() -> None:
    """`make image` tags the image with pyproject's version; the chart's default tag is its
    appVersion: the two move together."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((CHART.parents[2] / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


# -- per-role pod settings -----------------------------------------------------------------------

TANDEM_COMPONENTS = ("router", "prefill", "decode", "controller")


def test_per_role_pod_settings(helm: Helm, tmp_path: Path) -> None:
    """runtimeClassName, priorityClassName, extraVolumes (pod) and extraVolumeMounts (the main
    container) per component, next to its own nodeSelector, tolerations and affinity."""
    node_affinity = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["serving"]}]}
            ]
        }
    }
    values = {
        component: {
            "runtimeClassName": f"rc-{component}",
            "priorityClassName": f"pc-{component}",
            "extraVolumes": [{"name": "extra", "configMap": {"name": f"cm-{component}"}}],
            "extraVolumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}],
            "nodeSelector": {"pool": component},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": node_affinity},
        }
        for component in TANDEM_COMPONENTS
    }
    objects = helm.render(*_values(tmp_path, values))
    for component in TANDEM_COMPONENTS:
        pod = _pod(objects, component)
        assert pod["runtimeClassName"] == f"rc-{component}"
        assert pod["priorityClassName"] == f"pc-{component}"
        assert pod["nodeSelector"] == {"pool": component}
        assert pod["tolerations"] == values[component]["tolerations"]
        assert pod["affinity"] == {"nodeAffinity": node_affinity}
        # Appended after the chart's own volumes (the model's; none for the controller).
        model = [] if component == "controller" else ["model"]
        assert [v["name"] for v in pod["volumes"]] == [*model, "extra"]
        assert pod["volumes"][-1] == {"name": "extra", "configMap": {"name": f"cm-{component}"}}
        (container,) = pod["containers"]
        assert container["volumeMounts"][-1] == {
            "name": "extra",
            "mountPath": "/etc/extra",
            "readOnly": True,
        }
        for init in pod.get("initContainers", []):  # the model generator keeps its own
            assert [m["name"] for m in init["volumeMounts"]] == ["model"]
    manifest = yaml.safe_dump_all(objects)
    proc = kubernetes_validate(manifest, "1.30")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # Left empty (the default), none of them is rendered.
    objects = helm.render()
    for component in TANDEM_COMPONENTS:
        pod = _pod(objects, component)
        assert not {"runtimeClassName", "priorityClassName"} & set(pod)
    assert "volumes" not in _pod(objects, "controller")
    assert "volumeMounts" not in _pod(objects, "controller")["containers"][0]


# -- placement preset ----------------------------------------------------------------------------


def test_placement_preset_is_off_by_default(helm: Helm) -> None:
    for flags in ([], ["-f", str(GPU_VALUES)]):
        for workload in _workloads(helm.render(*flags)):
            pod = workload["spec"]["template"]["spec"]
            assert "podAffinity" not in pod.get("affinity", {})
            assert "topologySpreadConstraints" not in pod


@pytest.mark.parametrize("topology_key", [None, "example.com/rack"])
def test_colocated_pools(helm: Helm, tmp_path: Path, topology_key: str | None) -> None:
    """placement.colocatePools: prefill prefers the topology domains of decode pods and vice
    versa (KV moves over the local fabric); each worker role spreads across nodes."""
    own_term = {
        "weight": 5,
        "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"app": "cache"}},
        },
    }
    placement: dict[str, Any] = {"colocatePools": True}
    if topology_key:
        placement["topologyKey"] = topology_key
    values = {
        "placement": placement,
        # A role's own affinity stays; the preset's term is appended to it.
        "prefill": {
            "affinity": {
                "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [own_term]}
            }
        },
    }
    objects = helm.render(*_values(tmp_path, values))
    release = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": RELEASE}
    for role, peer, own in (("prefill", "decode", [own_term]), ("decode", "prefill", [])):
        pod = _pod(objects, role)
        assert pod["affinity"] == {
            "podAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    *own,
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {
                                "matchLabels": {**release, "app.kubernetes.io/component": peer}
                            },
                            "topologyKey": topology_key or "topology.kubernetes.io/zone",
                        },
                    },
                ]
            }
        }
        assert pod["topologySpreadConstraints"] == [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {**release, "app.kubernetes.io/component": role}},
            }
        ]
    for component in ("router", "controller"):
        pod = _pod(objects, component)
        assert "affinity" not in pod and "topologySpreadConstraints" not in pod
    # The values are not changed in place: the user's term is there once.
    assert (
        _pod(objects, "prefill")["affinity"]["podAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ].count(own_term)
        == 1
    )
    proc = kubernetes_validate(yaml.safe_dump_all(objects), "1.30")
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- values.schema.json ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("router.replicas=three", "router.replicas: Invalid type. Expected: integer"),
        ("router.config.bogus=1", "Additional property bogus is not allowed"),
        ("router.config.host=0.0.0.0", "Additional property host is not allowed"),
        ("prefill.config.worker_id=w", "Additional property worker_id is not allowed"),
        ("controller.config.namespace=x", "Additional property namespace is not allowed"),
        ("decode.config.kv_cache_bytes=-1", "decode.config.kv_cache_bytes: Must be greater"),
        ("router.config.policy=random", "router.config.policy: router.config.policy must be one"),
        ("controller.config.actuator=k8s", "controller.config.actuator must be one of"),
        ("prefill.port=0", "prefill.port: Must be greater than or equal to 1"),
        ("routr.replicas=2", "Additional property routr is not allowed"),
        ("image.variant=rocm", 'image.variant must be one of the following: "cpu", "cuda"'),
        ("prefill.runtimeClassName=1", "prefill.runtimeClassName: Invalid type. Expected: string"),
        ("router.extraVolumeMounts[0].name=x", "router.extraVolumeMounts.0: mountPath is required"),
        ("placement.colocatePools=yes", "placement.colocatePools: Invalid type"),
        ("placement.colocate=true", "Additional property colocate is not allowed"),
        ("model.baked=1", "model.baked: Invalid type. Expected: boolean"),
    ],
)
def test_schema_rejects_bad_values(helm: Helm, flag: str, message: str) -> None:
    with pytest.raises(HelmError) as exc:
        helm.template("--set", flag)
    assert "don't meet the specifications of the schema" in str(exc.value)
    assert message in str(exc.value)


@pytest.mark.parametrize("component", list(CONFIGS))
def test_schema_config_properties_are_the_dataclass_fields(component: str) -> None:
    """A field added to a config dataclass fails here until the chart knows it: either as
    a `<component>.config` property or as a chart-controlled field."""
    cls = CONFIGS[component]
    fields = _leaves(cls)
    controlled = set(CHART_CONTROLLED[cls]) - set(FIXED.get(cls, {}))
    assert controlled <= set(fields), f"chart controls fields {cls.__name__} lacks"
    config = _schema()["properties"][component]["properties"]["config"]
    assert config["additionalProperties"] is False
    assert set(config["properties"]) == set(fields) - controlled

    for name, prop in config["properties"].items():
        assert prop["type"] == _json_type(fields[name].type), name


@pytest.mark.parametrize("component", list(CONFIGS))
def test_config_values_round_trip_through_env(
    helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, component: str
) -> None:
    """Every settable field, written in a values file, reaches the process as the value it
    was given: values -> TANDEM_* env -> services.common.flags.parse_config."""
    cls = CONFIGS[component]
    fields = _leaves(cls)
    config = {
        leaf.name: leaf.default
        for leaf in fields.values()
        if leaf.name not in CHART_CONTROLLED[cls] and leaf.default is not None
    }
    config.update(NON_DEFAULTS[component])
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({component: {"config": config}}))
    objects = helm.render("-f", str(values))
    (container,) = containers(one(objects, "Deployment", _name(component)))
    env = env_of(container)
    for key in config:
        assert f"TANDEM_{key.upper()}" in env, key

    for name in list(os.environ):
        if name.startswith("TANDEM_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("TANDEM_"):
            # Downward-API values are the kubelet's to fill in.
            monkeypatch.setenv(name, value if isinstance(value, str) else "from-the-pod")
    parsed: Any = parse_config(cls, argv=[], fixed=FIXED.get(cls))
    for key, value in config.items():
        assert _get(parsed, fields[key]) == value, key


def test_every_rendered_tandem_env_is_a_field_of_its_dataclass(helm: Helm) -> None:
    for values in ([], ["-f", str(GPU_VALUES)], ["--set", "controller.config.max_step=3"]):
        objects = helm.render(*values)
        seen = set()
        for workload in _workloads(objects):
            component = _component(workload)
            for container in containers(workload) + (
                workload["spec"]["template"]["spec"].get("initContainers") or []
            ):
                names = [n for n in env_of(container) if n.startswith("TANDEM_")]
                if component == "redis" or container["name"] == "make-model":
                    assert names == []
                    continue
                fields = set(_leaves(CONFIGS[component]))
                for name in names:
                    assert name.removeprefix("TANDEM_").lower() in fields, (component, name)
                assert len(names) == len(set(names)), f"{component}: duplicate env"
                chart_set = set(CHART_CONTROLLED[CONFIGS[component]]) - NOT_RENDERED
                assert {f"TANDEM_{f.upper()}" for f in chart_set} <= set(names), component
                seen.add(component)
        assert seen == {"router", "prefill", "decode", "controller"}


# -- RBAC --------------------------------------------------------------------------------------


@pytest.mark.parametrize("release", ["tandem", "prod"])
def test_role_allows_only_get_and_patch_on_the_two_worker_scales(helm: Helm, release: str) -> None:
    objects = helm.render(release=release, namespace="serving")
    prefill, decode = _name("prefill", release), _name("decode", release)
    controller = _name("controller", release)
    assert one(objects, "Deployment", prefill) and one(objects, "Deployment", decode)
    (role,) = find(objects, "Role")
    assert role["metadata"]["name"] == controller
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": [prefill, decode],
            "verbs": ["get", "patch"],
        }
    ]
    assert find(objects, "ClusterRole") == [] and find(objects, "ClusterRoleBinding") == []
    (binding,) = find(objects, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": controller,
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": controller, "namespace": "serving"}
    ]
    one(objects, "ServiceAccount", controller)
    deployment = one(objects, "Deployment", controller)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == controller
    env = env_of(containers(deployment)[0])
    assert env["TANDEM_PREFILL_DEPLOYMENT"] == prefill
    assert env["TANDEM_DECODE_DEPLOYMENT"] == decode
    assert env["TANDEM_NAMESPACE"] == "serving"
    assert env["TANDEM_KUBECONFIG"] == ""
    assert env["TANDEM_ACTUATOR"] == "kubernetes"
    # No other pod gets API credentials.
    for workload in _workloads(objects):
        if workload is not deployment:
            assert workload["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# -- workers -----------------------------------------------------------------------------------


def test_worker_pods(helm: Helm) -> None:
    objects = helm.render("--set-json", "decode.config.drain_timeout_s=100.5")
    for role, drain in (("prefill", 30), ("decode", 100.5)):
        deployment = one(objects, "Deployment", _name(role))
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = env_of(container)
        assert container["command"] == ["python", "-m", f"services.{role}"]
        assert env["TANDEM_HOST"] == "0.0.0.0"
        assert env["TANDEM_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["TANDEM_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["TANDEM_PORT"] == str(container["ports"][0]["containerPort"])
        assert env["TANDEM_MODEL_DIR"] == "/models/tandem-tiny-small"
        assert pod["terminationGracePeriodSeconds"] > drain
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in container[
            "volumeMounts"
        ]
        # The controller owns the worker counts: a manifest replica count would make every
        # `helm upgrade` undo its decisions.
        assert "replicas" not in deployment["spec"]
    assert one(objects, "Deployment", _name("router"))["spec"]["replicas"] == 2


@pytest.mark.parametrize(
    "flags", [["--set", "controller.enabled=false"], ["--set", "controller.config.actuator=none"]]
)
def test_fixed_worker_counts_without_the_kubernetes_actuator(helm: Helm, flags: list[str]) -> None:
    objects = helm.render(*flags, "--set", "prefill.replicas=3", "--set", "decode.replicas=5")
    assert one(objects, "Deployment", _name("prefill"))["spec"]["replicas"] == 3
    assert one(objects, "Deployment", _name("decode"))["spec"]["replicas"] == 5


MODEL_PODS = ("router", "prefill", "decode")  # the pods that read the model


def test_generated_demo_model_by_default(helm: Helm) -> None:
    """Neither model.volume nor model.baked: an init container writes the demo model into an
    emptyDir that the main container mounts read-only."""
    objects = helm.render()
    for component in MODEL_PODS:
        pod = _pod(objects, component)
        (init,) = pod["initContainers"]
        assert init["name"] == "make-model"
        assert init["command"] == [
            "tandem", "make-tiny-model", "/models/tandem-tiny-small", "--preset", "small"
        ]  # fmt: skip
        assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
        assert pod["volumes"] == [{"name": "model", "emptyDir": {}}]
        (container,) = pod["containers"]
        assert container["volumeMounts"] == [
            {"name": "model", "mountPath": "/models", "readOnly": True}
        ]
    assert "initContainers" not in _pod(objects, "controller")


def test_model_volume_from_values(helm: Helm, tmp_path: Path) -> None:
    values = {
        "model": {
            "dir": "/weights/llama",
            "mountPath": "/weights",
            "volume": {"persistentVolumeClaim": {"claimName": "llama", "readOnly": True}},
        }
    }
    objects = helm.render(*_values(tmp_path, values))
    for component in MODEL_PODS:
        pod = _pod(objects, component)
        assert "initContainers" not in pod  # nothing to generate
        assert pod["volumes"] == [
            {"name": "model", "persistentVolumeClaim": {"claimName": "llama", "readOnly": True}}
        ]
        assert pod["containers"][0]["volumeMounts"] == [
            {"name": "model", "mountPath": "/weights", "readOnly": True}
        ]
        assert env_of(pod["containers"][0])["TANDEM_MODEL_DIR"] == "/weights/llama"
    with pytest.raises(HelmError, match="model.dir .* must lie under model.mountPath"):
        helm.template("--set", "model.dir=/elsewhere/llama")


@pytest.mark.parametrize("gpu", [False, True], ids=["default", "gpu"])
def test_baked_model(helm: Helm, tmp_path: Path, gpu: bool) -> None:
    """model.baked: the model is at model.dir inside the image: no model volume, no mount, no
    init container (and model.dir need not lie under mountPath)."""
    values = {"model": {"baked": True, "dir": "/opt/tandem/model", "volume": None}}
    objects = helm.render(*(["-f", str(GPU_VALUES)] if gpu else []), *_values(tmp_path, values))
    for component in MODEL_PODS:
        pod = _pod(objects, component)
        (container,) = pod["containers"]
        assert "initContainers" not in pod
        assert env_of(container)["TANDEM_MODEL_DIR"] == "/opt/tandem/model"
        volumes = [v["name"] for v in pod.get("volumes", [])]
        mounts = [m["name"] for m in container.get("volumeMounts", [])]
        # The GPU workers keep their memory-backed /dev/shm; nothing else is mounted.
        shm = ["dshm"] if gpu and component != "router" else []
        assert volumes == shm and mounts == shm, component
    proc = kubernetes_validate(yaml.safe_dump_all(objects), "1.30")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with pytest.raises(HelmError, match="either model.baked .* or model.volume, not both"):
        helm.template("-f", str(GPU_VALUES), "--set", "model.baked=true")


def test_gpu_values(helm: Helm) -> None:
    objects = helm.render("-f", str(GPU_VALUES))
    for role in ("prefill", "decode"):
        pod = one(objects, "Deployment", _name(role))["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
        assert any(key.startswith("rdma/") for key in limits)
        env = env_of(container)
        assert env["UCX_TLS"].startswith("rc")
        # Pods reach each other over RDMA only: no CUDA IPC or shared memory across pods.
        assert not {"cuda_ipc", "sm", "cma"} & set(env["UCX_TLS"].split(","))
        # Both sides run the GPU in bfloat16: a decode worker refuses KV of another dtype.
        assert env["TANDEM_DEVICE"] == "cuda" and env["TANDEM_DTYPE"] == "bfloat16"
        # KV is sized against the GPU, and loading + warm-up get a GPU-sized startup budget.
        assert float(env["TANDEM_GPU_MEMORY_UTILIZATION"]) == 0.9
        assert "TANDEM_KV_CACHE_BYTES" not in env
        probe = container["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert pod["nodeSelector"]
        assert pod["runtimeClassName"] == "nvidia"
        drain = float(env["TANDEM_DRAIN_TIMEOUT_S"])
        assert pod["terminationGracePeriodSeconds"] > drain
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod[
            "volumes"
        ]
    router = containers(one(objects, "Deployment", _name("router")))[0]
    assert not any(name.startswith("UCX_") for name in env_of(router))
    assert "nvidia.com/gpu" not in json.dumps(router)
    for component in ("router", "controller"):  # no GPU: the cluster's default runtime
        assert "runtimeClassName" not in _pod(objects, component)


# -- Redis -------------------------------------------------------------------------------------


def _redis_urls(objects: list[dict[str, Any]]) -> dict[str, str]:
    urls = {}
    for workload in _workloads(objects):
        env = env_of(containers(workload)[0])
        if "TANDEM_REDIS_URL" in env:
            urls[_component(workload)] = env["TANDEM_REDIS_URL"]
    return urls


def test_bundled_redis(helm: Helm) -> None:
    objects = helm.render()
    statefulset = one(objects, "StatefulSet", _name("redis"))
    service = one(objects, "Service", _name("redis"))
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert containers(statefulset)[0]["image"] == "redis:7.2"
    port = service["spec"]["ports"][0]["port"]
    url = f"redis://{_name('redis')}:{port}/0"
    assert _redis_urls(objects) == dict.fromkeys(["router", "prefill", "decode", "controller"], url)


def test_external_redis(helm: Helm) -> None:
    url = "rediss://cache.example.com:6380/2"
    objects = helm.render("--set", "redis.enabled=false", "--set", f"redis.url={url}")
    assert find(objects, "StatefulSet") == []
    assert [o for o in objects if _component(o) == "redis"] == []
    assert _redis_urls(objects) == dict.fromkeys(["router", "prefill", "decode", "controller"], url)
    with pytest.raises(HelmError, match="redis.url is required when redis.enabled is false"):
        helm.template("--set", "redis.enabled=false")
    with pytest.raises(HelmError, match="not both"):
        helm.template("--set", f"redis.url={url}")


# -- network policy ----------------------------------------------------------------------------


def test_network_policies(helm: Helm) -> None:
    objects = helm.render()
    release = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": RELEASE}
    workers = {
        "key": "app.kubernetes.io/component",
        "operator": "In",
        "values": ["prefill", "decode"],
    }
    policies = {p["metadata"]["name"]: p["spec"] for p in find(objects, "NetworkPolicy")}
    assert set(policies) == {_name(c) for c in ("router", "workers", "controller", "redis")}
    for spec in policies.values():
        assert spec["policyTypes"] == ["Ingress"]

    # Clients reach the router's port only, from anywhere.
    assert policies[_name("router")]["ingress"] == [{"ports": [{"port": 50051, "protocol": "TCP"}]}]
    # Release pods reach the workers' gRPC ports; workers reach each other on any port.
    worker_policy = policies[_name("workers")]
    assert worker_policy["podSelector"] == {"matchLabels": release, "matchExpressions": [workers]}
    from_release, from_workers = worker_policy["ingress"]
    assert from_release == {
        "from": [{"podSelector": {"matchLabels": release}}],
        "ports": [{"port": 50052, "protocol": "TCP"}, {"port": 50053, "protocol": "TCP"}],
    }
    assert from_workers == {
        "from": [{"podSelector": {"matchLabels": release, "matchExpressions": [workers]}}]
    }
    # Controller and Redis: this release's pods only, on their ports.
    (controller_rule,) = policies[_name("controller")]["ingress"]
    assert controller_rule["from"] == [{"podSelector": {"matchLabels": release}}]
    assert [p["port"] for p in controller_rule["ports"]] == [50061, 9090]
    (redis_rule,) = policies[_name("redis")]["ingress"]
    assert redis_rule == {
        "from": [{"podSelector": {"matchLabels": release}}],
        "ports": [{"port": 6379, "protocol": "TCP"}],
    }
    # Every pod of the release carries the labels the rules select on.
    for workload in _workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert release.items() <= labels.items()


def test_network_policy_peers_from_values(helm: Helm, tmp_path: Path) -> None:
    monitoring = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    clients = {"podSelector": {"matchLabels": {"role": "frontend"}}}
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump({"networkPolicy": {"routerFrom": [clients], "metricsFrom": [monitoring]}})
    )
    objects = helm.render("-f", str(values))
    router = one(objects, "NetworkPolicy", _name("router"))["spec"]
    assert router["ingress"][0]["from"] == [clients]
    controller = one(objects, "NetworkPolicy", _name("controller"))["spec"]
    assert controller["ingress"][1] == {
        "from": [monitoring],
        "ports": [{"port": 9090, "protocol": "TCP"}],
    }
    assert find(helm.render("--set", "networkPolicy.enabled=false"), "NetworkPolicy") == []


# -- ServiceMonitor ----------------------------------------------------------------------------


def test_service_monitor(helm: Helm) -> None:
    assert find(helm.render(), "ServiceMonitor") == []
    with pytest.raises(HelmError, match="does not serve monitoring.coreos.com/v1 ServiceMonitor"):
        helm.template("--set", "controller.serviceMonitor.enabled=true")

    objects = helm.render(
        "--set",
        "controller.serviceMonitor.enabled=true",
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
    )
    monitor = one(objects, "ServiceMonitor", _name("controller"))
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = one(objects, "Service", _name("controller"))
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert {"name": "metrics", "port": 9090} in [
        {"name": p["name"], "port": p["port"]} for p in service["spec"]["ports"]
    ]
