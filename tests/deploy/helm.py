"""Run the real helm 3 binary (scripts/ensure-helm.sh) on deploy/helm/tandem, and the
kubernetes-validate CLI on what it renders."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "tandem"
GPU_VALUES = CHART / "values-gpu.yaml"
ENSURE_HELM = REPO / "scripts" / "ensure-helm.sh"


class HelmError(RuntimeError):
    pass


def ensure_helm() -> Path:
    """scripts/ensure-helm.sh (installs helm once into a cache outside the clone)."""
    proc = subprocess.run(["bash", str(ENSURE_HELM)], capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise HelmError(f"{ENSURE_HELM} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return Path(lines[-1])


@dataclass(frozen=True)
class Helm:
    """helm with its cache/config/data dirs under `home`, so tests touch no user state."""

    binary: Path
    home: Path

    def run(
        self, *args: str, check: bool = True, timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        env.pop("KUBECONFIG", None)
        proc = subprocess.run(
            [str(self.binary), *args], capture_output=True, text=True, env=env, timeout=timeout_s
        )
        if check and proc.returncode != 0:
            raise HelmError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def template(self, *args: str, release: str = "tandem", namespace: str = "tandem") -> str:
        """`helm template` text of the chart (raises HelmError with helm's message)."""
        return self.run("template", release, str(CHART), "--namespace", namespace, *args).stdout

    def render(
        self, *args: str, release: str = "tandem", namespace: str = "tandem"
    ) -> list[dict[str, Any]]:
        """The rendered objects, parsed."""
        text = self.template(*args, release=release, namespace=namespace)
        return [doc for doc in yaml.safe_load_all(text) if doc]


def kubernetes_validate(manifest: str, kube_version: str) -> subprocess.CompletedProcess[str]:
    """`kubernetes-validate --strict -k VERSION -` on a multi-document manifest."""
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", kube_version, "-"],
        input=manifest,
        capture_output=True,
        text=True,
        timeout=120,
    )


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list(obj["spec"]["template"]["spec"]["containers"])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value (or the valueFrom mapping)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
