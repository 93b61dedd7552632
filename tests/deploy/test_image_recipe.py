"""The CUDA image's recipe (scripts/build-image.sh cuda), checked without building it: its
Debian package closure holds what Triton needs to launch a kernel (a C compiler, the C
headers, Python.h), and its wheels resolve from PyPI to the CUDA torch, triton and the CUDA 13
NIXL flavour even under a pip configuration whose find-links directory holds a CPU torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build-image.sh"
# What Triton's launcher build needs, as files of the image's bookworm (Python 3.11).
NEEDED_FILES = {
    "Python.h": "/usr/include/python3.11/Python.h",
    "C headers": "/usr/include/stdlib.h",
    "C compiler": "/usr/bin/gcc",
}


def _packages(variant: str) -> list[str]:
    out = subprocess.run(
        [str(SCRIPT), variant, "packages"], check=True, capture_output=True, text=True
    ).stdout
    return out.split()


def _closure(packages: list[str]) -> set[str]:
    """Every package apt installs for `packages` on an empty system, without Recommends (as
    mmdebstrap does): a simulation against this machine's package lists."""
    proc = subprocess.run(
        ["apt-get", "--simulate", "-q", "-o", "Dir::State::status=/dev/null",
         "-o", "APT::Install-Recommends=false", "install", *packages],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"apt-get cannot resolve the image's packages here: {proc.stderr[-500:]}")
    return {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("Inst ")}


def _provider(path: str) -> str:
    """The Debian package that ships `path` (dpkg -S on this bookworm machine)."""
    proc = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"{path} is not installed here, so dpkg cannot name its package")
    return proc.stdout.split(":", 1)[0]


@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs Debian's apt-get and dpkg")
def test_cuda_package_closure_has_a_compiler_and_python_headers() -> None:
    packages = _packages("cuda")
    providers = {what: _provider(path) for what, path in NEEDED_FILES.items()}
    assert providers["Python.h"] == "libpython3.11-dev"
    closure = _closure(packages)
    missing = {what: pkg for what, pkg in providers.items() if pkg not in closure}
    assert not missing, f"the cuda image's packages {packages} do not pull {missing}"
    # The check tells: without python3-dev the same closure has no Python.h.
    without_dev = _closure([p for p in packages if p != "python3-dev"])
    assert providers["Python.h"] not in without_dev


def _pypi_reachable() -> str | None:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/torch/", timeout=10):
            return None
    except OSError as exc:
        return f"PyPI is unreachable here ({exc}): the CUDA wheels cannot be resolved"


def test_cuda_wheels_resolve_to_the_cuda_torch_under_a_cpu_find_links(tmp_path: Path) -> None:
    reason = _pypi_reachable()
    if reason:
        pytest.skip(reason)
    # The trap of issue 22: a find-links directory with a CPU torch, in the user's pip.conf
    # and in PIP_FIND_LINKS. pip would rank it above PyPI's 2.13.0 (and fail on this empty
    # file); the recipe must not see it.
    links = tmp_path / "wheels"
    links.mkdir()
    (links / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    (tmp_path / "pip").mkdir()
    (tmp_path / "pip" / "pip.conf").write_text(f"[global]\nfind-links = {links}\n")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "PIP_FIND_LINKS": str(links)}
    proc = subprocess.run(
        [str(SCRIPT), "cuda", "wheels"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = {}
    for line in proc.stdout.splitlines():
        name, version, url = line.split()
        wheels[name.lower()] = (version, url)
    assert wheels["torch"][0] == "2.13.0"
    assert not any("+" in version for version, _ in wheels.values()), wheels
    assert all(url.startswith("https://") for _, url in wheels.values()), wheels
    assert "triton" in wheels
    assert any(name.startswith("nvidia-cudnn-cu13") for name in wheels)  # CUDA 13 torch
    assert wheels["nixl-cu13"][0] == wheels["nixl"][0] == "1.5.1"
    assert "nixl-cu12" not in wheels  # one NIXL flavour, the CUDA 13 one
