"""Session fixtures for the deployment tests: the real helm binary and a real API server.

Neither is skipped when missing: the fixtures run scripts/ensure-helm.sh and
scripts/ensure-kube.sh (quick once cached) and fail with their message if those fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.helm import Helm, HelmError, ensure_helm
from tests.deploy.kube import KubeCluster, KubeUnavailable, ensure_kube_bin


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    try:
        binary = ensure_helm()
    except HelmError as exc:
        pytest.fail(f"cannot get helm: {exc}", pytrace=False)
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """etcd + kube-apiserver 1.20.2 for the whole session, torn down at its end."""
    try:
        cluster = KubeCluster(tmp_path_factory.mktemp("kube"), ensure_kube_bin())
        cluster.start()
    except KubeUnavailable as exc:
        pytest.fail(f"cannot start a Kubernetes API server: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
