"""The chart's KV tiers (issue 44): config.kv_host_bytes / kv_disk_bytes as TANDEM_* env, and
<role>.kvDisk, the disk tier's volume (an emptyDir, or each pod's subdirectory of a claim),
rendered by the real helm 3 and checked against the Kubernetes schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.helm import Helm, HelmError, containers, env_of, kubernetes_validate, one

TIB = 1 << 40


def _deployment(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return one(objects, "Deployment", f"tandem-{role}")


def _kv_disk(objects: list[dict[str, Any]], role: str) -> tuple[Any, Any, dict[str, Any]]:
    """The role's kv-disk volume and mount (None when absent) and its container's env."""
    pod = _deployment(objects, role)["spec"]["template"]["spec"]
    (container,) = containers(_deployment(objects, role))
    volume = next((v for v in pod.get("volumes", []) if v["name"] == "kv-disk"), None)
    mounts = container.get("volumeMounts", [])
    mount = next((m for m in mounts if m["name"] == "kv-disk"), None)
    return volume, mount, env_of(container)


def test_no_tier_and_no_volume_by_default(helm: Helm) -> None:
    objects = helm.render()
    for role in ("prefill", "decode"):
        volume, mount, env = _kv_disk(objects, role)
        assert (volume, mount) == (None, None)
        assert not {"TANDEM_KV_HOST_BYTES", "TANDEM_KV_DISK_DIR", "TANDEM_KV_DISK_BYTES"} & set(env)


def test_kv_disk_on_an_empty_dir_and_a_claim(helm: Helm, tmp_path: Path) -> None:
    values = {
        "prefill": {
            "config": {"kv_host_bytes": 32 << 30, "kv_disk_bytes": TIB},
            "kvDisk": {"enabled": True},  # the default mount path, sizeLimit from the budget
        },
        "decode": {
            "config": {"kv_disk_bytes": 8 << 30},
            "kvDisk": {
                "enabled": True,
                "mountPath": "/nvme/kv",
                "persistentVolumeClaim": {"claimName": "decode-kv"},
            },
            "extraVolumes": [{"name": "cache", "emptyDir": {}}],
            "extraVolumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        },
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    objects = helm.render("-f", str(path))

    volume, mount, env = _kv_disk(objects, "prefill")
    # An eighth over the budget: the tier's own files and a write in flight stay inside it.
    assert volume == {"name": "kv-disk", "emptyDir": {"sizeLimit": str(TIB + TIB // 8)}}
    assert mount == {"name": "kv-disk", "mountPath": "/var/cache/tandem-kv"}
    assert env["TANDEM_KV_DISK_DIR"] == "/var/cache/tandem-kv"
    assert (env["TANDEM_KV_DISK_BYTES"], env["TANDEM_KV_HOST_BYTES"]) == (str(TIB), str(32 << 30))

    volume, mount, env = _kv_disk(objects, "decode")
    assert volume == {"name": "kv-disk", "persistentVolumeClaim": {"claimName": "decode-kv"}}
    # Each pod its own subdirectory of the shared claim: two workers never share one.
    assert mount == {
        "name": "kv-disk",
        "mountPath": "/nvme/kv",
        "subPathExpr": "$(TANDEM_WORKER_ID)",
    }
    assert env["TANDEM_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert (env["TANDEM_KV_DISK_DIR"], env["TANDEM_KV_DISK_BYTES"]) == ("/nvme/kv", str(8 << 30))
    assert "TANDEM_KV_HOST_BYTES" not in env
    pod = _deployment(objects, "decode")["spec"]["template"]["spec"]
    (container,) = containers(_deployment(objects, "decode"))
    assert {"name": "cache", "emptyDir": {}} in pod["volumes"]  # the extra ones stay
    assert {"name": "cache", "mountPath": "/cache"} in container["volumeMounts"]

    proc = kubernetes_validate(helm.template("-f", str(path)), "1.30")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kv_disk_size_limit_and_medium_as_given(helm: Helm) -> None:
    objects = helm.render(
        "--set", "decode.kvDisk.enabled=true", "--set", "decode.kvDisk.sizeLimit=20Gi",
        "--set", "decode.kvDisk.medium=Memory", "--set", "decode.config.kv_disk_bytes=1000",
    )  # fmt: skip
    volume, _, env = _kv_disk(objects, "decode")
    assert volume == {"name": "kv-disk", "emptyDir": {"sizeLimit": "20Gi", "medium": "Memory"}}
    assert env["TANDEM_KV_DISK_BYTES"] == "1000"
    assert _kv_disk(objects, "prefill")[0] is None  # per role


def test_a_disk_dir_of_ones_own_without_the_volume(helm: Helm) -> None:
    """config.kv_disk_dir names a directory the pod has some other way (extraVolumes)."""
    objects = helm.render(
        "--set", "prefill.config.kv_disk_dir=/cache/kv", "--set", "prefill.config.kv_disk_bytes=5",
    )  # fmt: skip
    volume, mount, env = _kv_disk(objects, "prefill")
    assert (volume, mount, env["TANDEM_KV_DISK_DIR"]) == (None, None, "/cache/kv")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["prefill.kvDisk.enabled=true"], "prefill.config: kv_disk_bytes is required"),
        (
            ["decode.kvDisk.enabled=true", "decode.config.kv_disk_bytes=0"],
            "decode.config.kv_disk_bytes: Must be greater than or equal to 1",
        ),
        (
            ["prefill.kvDisk.enabled=true", "prefill.config.kv_disk_bytes=5",
             "prefill.config.kv_disk_dir=/x"],
            "prefill.config.kv_disk_dir does not match",
        ),
        # Without the volume, the disk tier's two halves both or neither (as the workers).
        (["prefill.config.kv_disk_bytes=5"], "prefill.config: kv_disk_dir is required"),
        (["decode.config.kv_disk_dir=/x"], "decode.config: kv_disk_bytes is required"),
        (
            ["decode.config.kv_disk_dir=/x", "decode.config.kv_disk_bytes=0"],
            "decode.config.kv_disk_bytes: Must be greater than or equal to 1",
        ),
        (["decode.kvDisk.mountPath=relative"], "decode.kvDisk.mountPath: Does not match pattern"),
        (["decode.kvDisk.sizeLimit=lots"], "decode.kvDisk.sizeLimit: Does not match pattern"),
        (["prefill.kvDisk.medium=Disk"], "prefill.kvDisk.medium must be one of"),
        (["prefill.kvDisk.enabled=yes"], "prefill.kvDisk.enabled: Invalid type"),
        (["decode.kvDisk.claimName=x"], "Additional property claimName is not allowed"),
        (["prefill.config.kv_host_bytes=-1"], "prefill.config.kv_host_bytes: Must be greater"),
    ],
)  # fmt: skip
def test_schema_refuses_bad_kv_tier_values(helm: Helm, flags: list[str], message: str) -> None:
    with pytest.raises(HelmError) as exc:
        helm.template(*(arg for flag in flags for arg in ("--set", flag)))
    assert "don't meet the specifications of the schema" in str(exc.value)
    assert message in str(exc.value)
