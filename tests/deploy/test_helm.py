"""deploy/helm/tandem rendered by the real helm 3: lint, Kubernetes schemas, the values
schema against the config dataclasses, RBAC, env, probes and API versions per cluster."""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.services.common.runtime.flags import Leaf, leaves, parse_config
from tandem.services.common.security import KeyRing
from tandem.services.common.worker.config import WorkerConfig
from tandem.services.controller.config import ControllerConfig
from tandem.services.router.config import RouterConfig
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
# Every component: the internal plane's credential files (values auth.clusterSecret,
# auth.internalTls), mounted from Secrets, or "" when off.
INTERNAL_AUTH = {
    "cluster_secret_file": "auth.clusterSecret",
    "internal_tls_cert_file": "auth.internalTls",
    "internal_tls_key_file": "auth.internalTls",
    "internal_ca_file": "auth.internalTls",
}
CHART_CONTROLLED: dict[type, dict[str, str]] = {
    RouterConfig: {
        "host": "listenAddress (the pod IP)",
        "port": "router.port",
        "metrics_port": "router.metricsPort",
        "http_port": "router.httpPort",
        "redis_url": "bundled or external Redis",
        "model_dir": "model.dir",
        "prefill_addresses": "not rendered: workers are found through Redis",
        "decode_addresses": "not rendered: workers are found through Redis",
        "api_keys_file": "auth.apiKeys",
        "tls_cert_file": "auth.tls",
        "tls_key_file": "auth.tls",
        **INTERNAL_AUTH,
    },
    WorkerConfig: {
        "host": "listenAddress (the pod IP)",
        "port": "<role>.port",
        "metrics_port": "<role>.metricsPort",
        "advertise_host": "the pod IP",
        "worker_id": "the pod name",
        "redis_url": "bundled or external Redis",
        "model_dir": "model.dir",
        "tensor_parallel_size": "<role>.tensorParallelSize (and the pod's GPU count)",
        "role": "not rendered: the service's own (python -m tandem.services.<role>)",
        **INTERNAL_AUTH,
    },
    ControllerConfig: {
        "host": "listenAddress (the pod IP)",
        "port": "controller.port",
        "metrics_port": "controller.metricsPort",
        "redis_url": "bundled or external Redis",
        "namespace": "the release namespace",
        "prefill_deployment": "the chart's prefill Deployment",
        "decode_deployment": "the chart's decode Deployment",
        "kubeconfig": "empty: in-cluster credentials",
        "admin_keys_file": "auth.adminKeys",
        **INTERNAL_AUTH,
    },
}
NOT_RENDERED = {"prefill_addresses", "decode_addresses", "role"}
# Fields the program sets itself (no flag, no env): see
# tandem.services.common.worker.shell.run_worker.
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
        "kv_cache_dtype": "fp8",
        "quantization": "int4",
        "quantization_group_size": 32,
        "kv_host_bytes": 34359738368,
        "kv_disk_dir": "/var/cache/kv",
        "kv_disk_bytes": 1099511627776,
    },
    "decode": {
        "kv_cache_bytes": 12884901888,
        "transport": "local",
        "drain_timeout_s": 100.5,
        "enable_prefix_caching": False,
        "device": "cpu",
        "kv_cache_dtype": "fp8",
        "quantization": "int8",
        "speculative": "ngram",
        "num_speculative_tokens": 8,
        "speculative_max_batch": 16,
        "speculative_suffix_share": True,
    },
    "controller": {"target_utilization": 0.55, "max_decode": 12, "actuator": "none"},
}
RELEASE, NAMESPACE = "tandem", "tandem"
POD_IP = {"fieldRef": {"fieldPath": "status.podIP"}}
# The credential Secrets each component mounts by default (values `auth`).
AUTH_VOLUMES = {
    "router": ["api-keys", "cluster-secret"],
    "prefill": ["cluster-secret"],
    "decode": ["cluster-secret"],
    "controller": ["cluster-secret", "admin-keys"],
}
AUTH_OFF = [
    "--set", "auth.apiKeys.enabled=false",
    "--set", "auth.clusterSecret.enabled=false",
    "--set", "auth.adminKeys.enabled=false",
    "--set", "auth.redisPassword.enabled=false",
]  # fmt: skip


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


TLS_ON = [
    "--set", "auth.tls.secretName=router-tls",
    "--set", "auth.internalTls.secretName=tandem-mtls",
]  # fmt: skip
VARIANTS = [[], ["-f", str(GPU_VALUES)], TLS_ON, ["--set", "auth.tls.secretName=router-tls"]]
VARIANT_IDS = ["default", "gpu", "tls", "router-tls"]


@pytest.mark.parametrize("values", [*VARIANTS, AUTH_OFF], ids=[*VARIANT_IDS, "auth-off"])
def test_lint_strict(helm: Helm, values: list[str]) -> None:
    proc = helm.run("lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("values", [*VARIANTS, AUTH_OFF], ids=[*VARIANT_IDS, "auth-off"])
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
            if _component(workload) == "router" and kind == "livenessProbe":
                # Through the HTTP API (the kubelet's HTTP probes work on every version).
                assert probe["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
                continue
            if native_grpc:
                assert probe["grpc"] == {"port": port}
                assert "exec" not in probe
            else:
                # The server listens on the pod IP, which exec probes learn from TANDEM_HOST
                # through a shell (they expand no downward-API variables themselves).
                shell, flag, script = probe["exec"]["command"]
                assert (shell, flag) == ("sh", "-c")
                args = script.split()
                assert args[:6] == [
                    "exec", "python", "-m", "tandem.services.common.rpc.healthcheck",
                    "--port", str(port),
                ]  # fmt: skip
                assert args[args.index("--host") + 1] == '"$TANDEM_HOST"'
                assert float(args[args.index("--timeout-s") + 1]) < probe["timeoutSeconds"]
                assert env_of(container)["TANDEM_HOST"] == POD_IP
                assert "grpc" not in probe


def test_exec_probe_without_the_pod_ip(helm: Helm) -> None:
    """listenAddress 0.0.0.0: the servers listen on every interface (kubectl port-forward
    reaches them) and the exec probe dials its default, 127.0.0.1."""
    objects = helm.render("--kube-version", "1.20.2", "--set", "listenAddress=0.0.0.0")
    for component in TANDEM_COMPONENTS:
        (container,) = containers(one(objects, "Deployment", _name(component)))
        assert env_of(container)["TANDEM_HOST"] == "0.0.0.0"
        port = str(container["ports"][0]["containerPort"])
        command = container["readinessProbe"]["exec"]["command"]
        assert command[:5] == [
            "python",
            "-m",
            "tandem.services.common.rpc.healthcheck",
            "--port",
            port,
        ]
        assert "--host" not in command


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
        # Appended after the chart's own volumes (the model's, none for the controller; then
        # the credential Secrets).
        model = [] if component == "controller" else ["model"]
        assert [v["name"] for v in pod["volumes"]] == [*model, *AUTH_VOLUMES[component], "extra"]
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
    controller = _pod(objects, "controller")
    assert [v["name"] for v in controller["volumes"]] == AUTH_VOLUMES["controller"]
    objects = helm.render(*AUTH_OFF)
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
        ("decode.config.kv_cache_dtype=int8", "decode.config.kv_cache_dtype must be one of"),
        ("prefill.config.quantization=int3", "prefill.config.quantization must be one of"),
        ("router.config.tool_call_parser=qwen", "router.config.tool_call_parser must be one of"),
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
    was given: values -> TANDEM_* env -> tandem.services.common.runtime.flags.parse_config."""
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
def test_role_allows_only_scales_and_status_of_the_two_workers(helm: Helm, release: str) -> None:
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
        },
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/status"],
            "resourceNames": [prefill, decode],
            "verbs": ["get"],
        },
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
        assert container["command"] == ["python", "-m", f"tandem.services.{role}"]
        assert env["TANDEM_HOST"] == env["TANDEM_ADVERTISE_HOST"] == POD_IP
        assert env["TANDEM_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["TANDEM_PORT"] == str(container["ports"][0]["containerPort"])
        assert env["TANDEM_MODEL_DIR"] == "/models/tandem-tiny-small"
        assert pod["terminationGracePeriodSeconds"] > drain
        # an upgrade starts the new pod before the old one drains (its streams move to it)
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
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
        assert pod["volumes"][0] == {"name": "model", "emptyDir": {}}
        assert [v["name"] for v in pod["volumes"]] == ["model", *AUTH_VOLUMES[component]]
        (container,) = pod["containers"]
        assert container["volumeMounts"][0] == {
            "name": "model",
            "mountPath": "/models",
            "readOnly": True,
        }
        assert len(container["volumeMounts"]) == len(pod["volumes"])
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
        assert pod["volumes"][0] == {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "llama", "readOnly": True},
        }
        assert pod["containers"][0]["volumeMounts"][0] == {
            "name": "model",
            "mountPath": "/weights",
            "readOnly": True,
        }
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
        # The GPU workers keep their memory-backed /dev/shm and the credentials; no model.
        shm = ["dshm"] if gpu and component != "router" else []
        assert volumes == mounts == [*shm, *AUTH_VOLUMES[component]], component
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


def test_tensor_parallel_size_sets_the_ranks_and_a_gpu_pod_s_gpus(helm: Helm) -> None:
    """Per role: TANDEM_TENSOR_PARALLEL_SIZE, and on a GPU pod one GPU per rank (requests
    and limits); a CPU pod's resources are left as given."""
    objects = helm.render("-f", str(GPU_VALUES), "--set", "prefill.tensorParallelSize=4")
    for role, tp in (("prefill", 4), ("decode", 1)):
        (container,) = containers(one(objects, "Deployment", _name(role)))
        assert env_of(container)["TANDEM_TENSOR_PARALLEL_SIZE"] == str(tp)
        resources = container["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
        assert resources["limits"]["nvidia.com/gpu"] == tp
        assert resources["limits"]["rdma/rdma_shared_device_a"] == 1  # not per rank
    objects = helm.render("--set", "decode.tensorParallelSize=2")
    (container,) = containers(one(objects, "Deployment", _name("decode")))
    assert env_of(container)["TANDEM_TENSOR_PARALLEL_SIZE"] == "2"
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    manifest = helm.template("-f", str(GPU_VALUES), "--set", "decode.tensorParallelSize=2")
    proc = kubernetes_validate(manifest, "1.30")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with pytest.raises(HelmError, match="tensorParallelSize"):
        helm.template("--set", "decode.tensorParallelSize=0")


def test_ucx_net_devices_unset_unless_named(helm: Helm) -> None:
    """UCX picks among the pod's devices by default (a fixed mlx5_0 is wrong on nodes with
    several NICs); transfer.netDevices pins them, and only on the workers."""
    for values in ([], ["-f", str(GPU_VALUES)]):
        objects = helm.render(*values)
        for role in ("prefill", "decode"):
            container = containers(one(objects, "Deployment", _name(role)))[0]
            assert "UCX_NET_DEVICES" not in env_of(container)
    objects = helm.render("-f", str(GPU_VALUES), "--set", "transfer.netDevices=mlx5_3:1")
    for role in ("prefill", "decode"):
        container = containers(one(objects, "Deployment", _name(role)))[0]
        assert env_of(container)["UCX_NET_DEVICES"] == "mlx5_3:1"
    router = containers(one(objects, "Deployment", _name("router")))[0]
    assert "UCX_NET_DEVICES" not in env_of(router)
    with pytest.raises(HelmError, match="UCX_NET_DEVICES"):  # one place to set it
        helm.template("--set", "transfer.env.UCX_NET_DEVICES=mlx5_0")


# -- Redis -------------------------------------------------------------------------------------


def _redis_urls(objects: list[dict[str, Any]]) -> dict[str, str]:
    urls = {}
    for workload in _workloads(objects):
        env = env_of(containers(workload)[0])
        if "TANDEM_REDIS_URL" in env:
            urls[_component(workload)] = env["TANDEM_REDIS_URL"]
    return urls


def test_bundled_redis(helm: Helm) -> None:
    """The bundled Redis requires the generated password; every component's URL carries it
    as $(REDIS_PASSWORD), an env entry filled from the Secret, declared before the URL."""
    objects = helm.render()
    statefulset = one(objects, "StatefulSet", _name("redis"))
    service = one(objects, "Service", _name("redis"))
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    (redis,) = containers(statefulset)
    assert redis["image"] == "redis:7.2"
    port = service["spec"]["ports"][0]["port"]
    url = f"redis://:$(REDIS_PASSWORD)@{_name('redis')}:{port}/0"
    assert _redis_urls(objects) == dict.fromkeys(["router", "prefill", "decode", "controller"], url)
    from_secret = {"secretKeyRef": {"name": _name("redis-password"), "key": "redis-password"}}
    for workload in _workloads(objects):
        names = [e["name"] for e in containers(workload)[0]["env"]]
        assert env_of(containers(workload)[0])["REDIS_PASSWORD"] == from_secret
        if "TANDEM_REDIS_URL" in names:  # the kubelet expands only variables defined earlier
            assert names.index("REDIS_PASSWORD") < names.index("TANDEM_REDIS_URL")
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert env_of(redis)["REDISCLI_AUTH"] == from_secret  # the redis-cli readiness probe
    assert redis["readinessProbe"]["exec"]["command"][0] == "redis-cli"

    # auth.redisPassword off: no password anywhere.
    objects = helm.render("--set", "auth.redisPassword.enabled=false")
    plain = f"redis://{_name('redis')}:{port}/0"
    assert _redis_urls(objects) == dict.fromkeys(TANDEM_COMPONENTS, plain)
    (redis,) = containers(one(objects, "StatefulSet", _name("redis")))
    assert "--requirepass" not in redis["args"] and "env" not in redis
    assert find(objects, "Secret", _name("redis-password")) == []


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
    assert find(objects, "Secret", _name("redis-password")) == []  # none to generate


def test_external_redis_password_from_a_secret(helm: Helm) -> None:
    objects = helm.render(
        "--set", "redis.enabled=false",
        "--set", "redis.url=rediss://cache.example.com:6380/2",
        "--set", "auth.redisPassword.existingSecret=cache-auth",
    )  # fmt: skip
    url = "rediss://:$(REDIS_PASSWORD)@cache.example.com:6380/2"
    assert _redis_urls(objects) == dict.fromkeys(["router", "prefill", "decode", "controller"], url)
    for workload in _workloads(objects):
        env = env_of(containers(workload)[0])
        assert env["REDIS_PASSWORD"] == {
            "secretKeyRef": {"name": "cache-auth", "key": "redis-password"}
        }
    assert find(objects, "Secret", _name("redis-password")) == []
    with pytest.raises(HelmError, match="redis.url holds credentials"):
        helm.template(
            "--set", "redis.enabled=false",
            "--set", "redis.url=redis://:hunter2@cache:6379/0",
            "--set", "auth.redisPassword.existingSecret=cache-auth",
        )  # fmt: skip


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

    # Clients reach the router's gRPC and HTTP ports from anywhere; release pods its metrics.
    assert policies[_name("router")]["ingress"] == [
        {"ports": [{"port": 50051, "protocol": "TCP"}, {"port": 8000, "protocol": "TCP"}]},
        {
            "from": [{"podSelector": {"matchLabels": release}}],
            "ports": [{"port": 9091, "protocol": "TCP"}],
        },
    ]
    # Release pods reach the workers' gRPC and metrics ports; workers reach each other on any
    # port.
    worker_policy = policies[_name("workers")]
    assert worker_policy["podSelector"] == {"matchLabels": release, "matchExpressions": [workers]}
    from_release, from_workers = worker_policy["ingress"]
    assert from_release == {
        "from": [{"podSelector": {"matchLabels": release}}],
        "ports": [
            {"port": 50052, "protocol": "TCP"},
            {"port": 50053, "protocol": "TCP"},
            {"port": 9092, "protocol": "TCP"},
        ],
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
    # The same peers reach the router's and the workers' metrics ports, and only those.
    router_metrics = router["ingress"][2]
    assert router_metrics == {"from": [monitoring], "ports": [{"port": 9091, "protocol": "TCP"}]}
    workers = one(objects, "NetworkPolicy", _name("workers"))["spec"]
    assert workers["ingress"][1] == {
        "from": [monitoring],
        "ports": [{"port": 9092, "protocol": "TCP"}],
    }
    assert find(helm.render("--set", "networkPolicy.enabled=false"), "NetworkPolicy") == []


# -- metrics ports, ServiceMonitors, PodMonitor -----------------------------------------------

MONITOR_APIS = [
    "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions", "monitoring.coreos.com/v1/PodMonitor",
]  # fmt: skip
MONITORS_ON = [
    "--set", "controller.serviceMonitor.enabled=true",
    "--set", "router.serviceMonitor.enabled=true",
    "--set", "podMonitor.enabled=true",
]  # fmt: skip
METRICS_PORTS = {"router": 9091, "prefill": 9092, "decode": 9092, "controller": 9090}


def test_metrics_ports(helm: Helm) -> None:
    """Every service's metrics port: a named container port, TANDEM_METRICS_PORT, and for the
    router and controller a Service port."""
    objects = helm.render()
    for component, port in METRICS_PORTS.items():
        (container,) = containers(one(objects, "Deployment", _name(component)))
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
        assert env_of(container)["TANDEM_METRICS_PORT"] == str(port)
    for component in ("router", "controller"):
        service = one(objects, "Service", _name(component))
        assert {
            "name": "metrics",
            "port": METRICS_PORTS[component],
            "targetPort": "metrics",
            "protocol": "TCP",
            "appProtocol": "http",
        } in service["spec"]["ports"]
    # 0 turns a /metrics off: no port, and the services' "off" (-1) in the env.
    objects = helm.render(
        "--set", "router.metricsPort=0",
        "--set", "decode.metricsPort=0",
        "--set", "prefill.metricsPort=9200",
    )  # fmt: skip
    expected: dict[str, int | None] = {"router": None, "decode": None, "prefill": 9200}
    for component, want in expected.items():
        (container,) = containers(one(objects, "Deployment", _name(component)))
        assert [p["containerPort"] for p in container["ports"] if p["name"] == "metrics"] == (
            [want] if want else []
        )
        assert env_of(container)["TANDEM_METRICS_PORT"] == str(want or -1)
    ports = one(objects, "Service", _name("router"))["spec"]["ports"]
    assert [p["name"] for p in ports] == ["grpc", "http"]


def test_openai_http_port(helm: Helm) -> None:
    """The router's HTTP API: a named container port, TANDEM_HTTP_PORT, a Service port and a
    liveness probe on /health (HTTPS with the router's TLS); httpPort 0 turns all off."""
    objects = helm.render("--set", "router.service.httpPort=80")
    (container,) = containers(one(objects, "Deployment", _name("router")))
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    assert env_of(container)["TANDEM_HTTP_PORT"] == "8000"
    service = one(objects, "Service", _name("router"))
    assert {
        "name": "http", "port": 80, "targetPort": "http", "protocol": "TCP", "appProtocol": "http",
    } in service["spec"]["ports"]  # fmt: skip
    http_get = {"path": "/health", "port": "http", "scheme": "HTTP"}
    assert container["livenessProbe"]["httpGet"] == http_get
    assert container["livenessProbe"]["periodSeconds"] == 10
    assert "grpc" in container["readinessProbe"] and "grpc" in container["startupProbe"]
    tls = helm.render("--set", "auth.tls.secretName=router-tls")
    (container,) = containers(one(tls, "Deployment", _name("router")))
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    off = helm.render("--set", "router.httpPort=0")
    (container,) = containers(one(off, "Deployment", _name("router")))
    assert all(p["name"] != "http" for p in container["ports"])
    assert env_of(container)["TANDEM_HTTP_PORT"] == "-1"
    assert "grpc" in container["livenessProbe"]
    ports = one(off, "Service", _name("router"))["spec"]["ports"]
    assert [p["name"] for p in ports] == ["grpc", "metrics"]


def test_monitors_are_off_by_default(helm: Helm) -> None:
    objects = helm.render(*MONITOR_APIS)
    assert find(objects, "ServiceMonitor") == [] and find(objects, "PodMonitor") == []


@pytest.mark.parametrize(
    ("flag", "kind"),
    [
        ("controller.serviceMonitor.enabled=true", "ServiceMonitor"),
        ("router.serviceMonitor.enabled=true", "ServiceMonitor"),
        ("podMonitor.enabled=true", "PodMonitor"),
    ],
)
def test_monitors_need_their_crd(helm: Helm, flag: str, kind: str) -> None:
    with pytest.raises(HelmError, match=f"does not serve monitoring.coreos.com/v1 {kind}"):
        helm.template("--set", flag)


@pytest.mark.parametrize("component", ["controller", "router"])
def test_service_monitor(helm: Helm, component: str) -> None:
    objects = helm.render(
        "--set", f"{component}.serviceMonitor.enabled=true",
        "--set-json", f'{component}.serviceMonitor.labels={{"release": "kube-prometheus"}}',
        "--set", f"{component}.serviceMonitor.scrapeTimeout=5s",
        *MONITOR_APIS,
    )  # fmt: skip
    (monitor,) = find(objects, "ServiceMonitor")
    assert monitor["metadata"]["name"] == _name(component)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    service = one(objects, "Service", _name(component))
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    # The selector picks this component's Service and no other.
    for other in find(objects, "Service"):
        if other is not service:
            labels = other["metadata"]["labels"].items()
            assert not monitor["spec"]["selector"]["matchLabels"].items() <= labels
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}
    ]
    assert {"name": "metrics", "port": METRICS_PORTS[component]} in [
        {"name": p["name"], "port": p["port"]} for p in service["spec"]["ports"]
    ]
    with pytest.raises(HelmError, match=f"needs {component}.metricsPort > 0"):
        helm.template(
            "--set", f"{component}.serviceMonitor.enabled=true",
            "--set", f"{component}.metricsPort=0",
            *MONITOR_APIS,
        )  # fmt: skip


def test_pod_monitor_selects_the_worker_pods(helm: Helm) -> None:
    objects = helm.render("--set", "podMonitor.enabled=true", *MONITOR_APIS)
    (monitor,) = find(objects, "PodMonitor")
    assert monitor["metadata"]["name"] == _name("workers")
    spec = monitor["spec"]
    assert spec["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}
    ]
    selector = spec["selector"]
    (expression,) = selector["matchExpressions"]
    for workload in _workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selected = selector["matchLabels"].items() <= labels.items() and (
            labels.get(expression["key"]) in expression["values"]
        )
        assert selected == (_component(workload) in ("prefill", "decode")), _component(workload)
        if selected:
            (container,) = containers(workload)
            assert "metrics" in [p["name"] for p in container["ports"]]
    with pytest.raises(HelmError, match="needs prefill.metricsPort > 0"):
        helm.template("--set", "podMonitor.enabled=true", "--set", "prefill.metricsPort=0",
                      *MONITOR_APIS)  # fmt: skip


def test_monitors_on_pass_kubernetes_validate(helm: Helm) -> None:
    # (helm 3.10's lint takes no --api-versions, so it cannot render the monitors: lint runs
    # on the other variants in test_lint_strict.)
    manifest = helm.template(*MONITORS_ON, *MONITOR_APIS)
    objects = [o for o in yaml.safe_load_all(manifest) if o]
    kinds = [o["kind"] for o in objects]
    assert kinds.count("ServiceMonitor") == 2 and kinds.count("PodMonitor") == 1
    proc = kubernetes_validate(manifest, "1.30")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # kubernetes-validate has no schemas for the Prometheus Operator's CRDs: it skips those
    # three with a warning and checks every other object.
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "WARN" in line]
    assert len(warnings) == 3
    assert all("monitoring.coreos.com/v1" in line for line in warnings), warnings
    assert proc.stdout.count("passed for resource") == len(objects) - 3


# -- credentials (values `auth`) -------------------------------------------------------------

GENERATED = ("api-keys", "cluster-secret", "admin-keys", "redis-password")  # Secret = its key
# component -> credential env -> the file it names, by default.
AUTH_FILES = {
    "router": {
        "TANDEM_API_KEYS_FILE": "/etc/tandem/api-keys/api-keys",
        "TANDEM_TLS_CERT_FILE": "",
        "TANDEM_TLS_KEY_FILE": "",
    },
    "prefill": {},
    "decode": {},
    "controller": {"TANDEM_ADMIN_KEYS_FILE": "/etc/tandem/admin-keys/admin-keys"},
}
INTERNAL_FILES = {
    "TANDEM_CLUSTER_SECRET_FILE": "/etc/tandem/cluster-secret/cluster-secret",
    "TANDEM_INTERNAL_TLS_CERT_FILE": "",
    "TANDEM_INTERNAL_TLS_KEY_FILE": "",
    "TANDEM_INTERNAL_CA_FILE": "",
}


def _secrets(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The rendered Secrets: name -> key -> decoded value."""
    return {
        o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o["data"].items()}
        for o in find(objects, "Secret")
    }


def _auth_env(container: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in env_of(container).items() if k.endswith("_FILE")}


def _plain_strings(objects: list[dict[str, Any]]) -> list[str]:
    """Every env value, command and argument of every container (init ones included)."""
    out = []
    for workload in _workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"] + pod.get("initContainers", []):
            out += [e["value"] for e in container.get("env", []) if "value" in e]
            out += container.get("command", []) + container.get("args", [])
    return out


def test_generated_credentials_are_mounted_where_they_are_used(helm: Helm) -> None:
    objects = helm.render()
    secrets = _secrets(objects)
    assert set(secrets) == {_name(what) for what in GENERATED}
    for what in GENERATED:
        assert list(secrets[_name(what)]) == [what]
    values = {what: secrets[_name(what)][what] for what in GENERATED}

    # The files parse as the services will read them.
    for what, tenant, scopes in (
        ("api-keys", "default", {"generate"}),
        ("admin-keys", "admin", {"admin"}),
    ):
        (line,) = values[what].splitlines()
        principal = KeyRing.parse(values[what]).lookup(line.split()[0])
        assert principal is not None, what
        assert (principal.tenant, principal.scopes) == (tenant, scopes)
    assert len(values["cluster-secret"]) >= 64 and len(values["redis-password"]) >= 32

    for component in TANDEM_COMPONENTS:
        pod = _pod(objects, component)
        (container,) = pod["containers"]
        assert _auth_env(container) == {**AUTH_FILES[component], **INTERNAL_FILES}, component
        volumes = {v["name"]: v for v in pod["volumes"] if "secret" in v}
        assert list(volumes) == AUTH_VOLUMES[component]
        for name, volume in volumes.items():
            assert volume["secret"]["secretName"] == _name(name)
            assert volume["secret"]["items"] == [{"key": name, "path": name}]
            assert volume["secret"]["defaultMode"] == 0o444  # the image runs as uid 10001
            assert {"name": name, "mountPath": f"/etc/tandem/{name}", "readOnly": True} in (
                container["volumeMounts"]
            )

    # No secret is written into the manifest outside its Secret.
    plain = _plain_strings(objects)
    for what, value in values.items():
        token = value.split()[0]
        assert not [p for p in plain if token in p], f"the {what} value is in plain text"


def test_each_render_generates_fresh_credentials(helm: Helm) -> None:
    """`helm template` sees no cluster: nothing to look up, so new values (an install keeps
    them on upgrade: tests/deploy/test_kube.py)."""
    first, second = _secrets(helm.render()), _secrets(helm.render())
    assert set(first) == set(second)
    for name in first:
        assert first[name] != second[name], name


def test_credentials_off(helm: Helm) -> None:
    objects = helm.render(*AUTH_OFF)
    assert find(objects, "Secret") == []
    for component in TANDEM_COMPONENTS:
        (container,) = _pod(objects, component)["containers"]
        files = {**AUTH_FILES[component], **INTERNAL_FILES}
        assert _auth_env(container) == dict.fromkeys(files, "")
        assert not [m for m in container.get("volumeMounts", []) if "/etc/tandem" in m["mountPath"]]


def test_existing_secrets_are_used_as_they_are(helm: Helm, tmp_path: Path) -> None:
    names = {
        "apiKeys": "my-api-keys",
        "clusterSecret": "my-cluster",
        "adminKeys": "my-admin",
        "redisPassword": "my-redis",
    }
    values = {"auth": {key: {"existingSecret": name} for key, name in names.items()}}
    objects = helm.render(*_values(tmp_path, values))
    assert find(objects, "Secret") == []  # the chart generates nothing
    router = _pod(objects, "router")
    assert {v["name"]: v["secret"]["secretName"] for v in router["volumes"] if "secret" in v} == {
        "api-keys": "my-api-keys",
        "cluster-secret": "my-cluster",
    }
    controller = _pod(objects, "controller")
    assert {
        v["name"]: v["secret"]["secretName"] for v in controller["volumes"] if "secret" in v
    } == {"cluster-secret": "my-cluster", "admin-keys": "my-admin"}
    (redis,) = containers(one(objects, "StatefulSet", _name("redis")))
    assert env_of(redis)["REDIS_PASSWORD"]["secretKeyRef"]["name"] == "my-redis"


@pytest.mark.parametrize("internal", [False, True], ids=["router-tls", "router-and-internal-tls"])
def test_tls_secrets(helm: Helm, monkeypatch: pytest.MonkeyPatch, internal: bool) -> None:
    """Router TLS from a kubernetes.io/tls Secret, internal mTLS from a Secret with a CA too;
    a TLS port is probed over TCP (the kubelet's gRPC probe speaks no TLS), and the files
    reach each config through its env."""
    flags = TLS_ON if internal else TLS_ON[:2]
    objects = helm.render(*flags)
    router = _pod(objects, "router")
    (container,) = router["containers"]
    env = env_of(container)
    assert env["TANDEM_TLS_CERT_FILE"] == "/etc/tandem/tls/tls.crt"
    assert env["TANDEM_TLS_KEY_FILE"] == "/etc/tandem/tls/tls.key"
    (tls,) = [v for v in router["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == "router-tls"
    assert [i["key"] for i in tls["secret"]["items"]] == ["tls.crt", "tls.key"]
    for component in TANDEM_COMPONENTS:
        (container,) = _pod(objects, component)["containers"]
        env = env_of(container)
        tls_port = internal or component == "router"
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = container[kind]
            port = container["ports"][0]["containerPort"]
            if component == "router" and kind == "livenessProbe":
                # HTTPS: the kubelet does not verify the certificate.
                assert probe["httpGet"]["scheme"] == "HTTPS"
                continue
            assert probe.get("tcpSocket") == ({"port": port} if tls_port else None), component
        if not internal:
            assert env["TANDEM_INTERNAL_CA_FILE"] == ""
            continue
        assert env["TANDEM_INTERNAL_TLS_CERT_FILE"] == "/etc/tandem/internal-tls/tls.crt"
        assert env["TANDEM_INTERNAL_TLS_KEY_FILE"] == "/etc/tandem/internal-tls/tls.key"
        assert env["TANDEM_INTERNAL_CA_FILE"] == "/etc/tandem/internal-tls/ca.crt"
        # The env parses into the component's config (AuthConfig checks the three together).
        for name in list(os.environ):
            if name.startswith("TANDEM_"):
                monkeypatch.delenv(name)
        for name, value in env.items():
            if name.startswith("TANDEM_"):
                monkeypatch.setenv(name, value if isinstance(value, str) else "from-the-pod")
        cls = CONFIGS[component]
        parsed: Any = parse_config(cls, argv=[], fixed=FIXED.get(cls))
        assert parsed.auth.internal_tls and parsed.auth.cluster_secret_file
        if component == "router":
            assert parsed.tls_cert_file == "/etc/tandem/tls/tls.crt"
            assert parsed.api_keys_file == "/etc/tandem/api-keys/api-keys"
    proc = kubernetes_validate(yaml.safe_dump_all(objects), "1.30")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_rejects_bad_auth_values(helm: Helm) -> None:
    for flag, message in (
        ("auth.apiKeys.enabled=yes", "auth.apiKeys.enabled: Invalid type"),
        ("auth.tls.secret=x", "Additional property secret is not allowed"),
        ("auth.apiKey.enabled=true", "Additional property apiKey is not allowed"),
        ("listenAddress=", "listenAddress: String length must be greater than or equal to 1"),
    ):
        with pytest.raises(HelmError, match=re.escape(message)):
            helm.template("--set", flag)
