"""The package as pip installs it (issue 39): one top-level name, `tandem`, so it shares an
environment with the newest transformers, which depends on Hugging Face's `kernels`.

The wheel is built from this checkout and installed, without dependencies, into a fresh
virtual environment together with the newest transformers the package index serves (and its
dependencies, `kernels` among them). Torch and the other heavy dependencies come from this
project's environment through a .pth line after the fresh environment's own site-packages,
so the fresh environment's transformers and kernels are the ones imported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(*cmd: str | Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv's
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"{cmd}: {out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout's tracked files, built in a copy of them (links kept as
    links): no stale build/ of the checkout can leak into it."""
    src = tmp_path_factory.mktemp("src")
    files = _run("git", "ls-files", "-z", cwd=REPO_ROOT).split("\0")
    for rel in filter(None, files):
        path, dest = REPO_ROOT / rel, src / rel
        if not (path.exists() or path.is_symlink()):
            continue  # deleted in the working tree
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            dest.symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, dest)
    dist = tmp_path_factory.mktemp("dist")
    _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
        "--wheel-dir", dist, src, cwd=src,
    )  # fmt: skip
    [built] = dist.glob("tandem-*.whl")
    return built


def test_the_wheel_claims_no_top_level_name_but_tandem(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert zf.read(top_level).decode().split() == ["tandem"]
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tandem"}
    # the linked folders are inside, with the C source the CPU kernels are built from
    for path in ("tandem/services/router/server.py", "tandem/kernels/cpu_ops.c",
                 "tandem/kernels/reference.py", "tandem/model/llama.py"):  # fmt: skip
        assert path in names


def test_it_installs_beside_the_newest_transformers_and_both_import(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    pip = (python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    _run(*pip, "--no-deps", wheel, cwd=tmp_path)
    _run(*pip, "--upgrade", "transformers", cwd=tmp_path)  # the newest the index serves
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                cwd=tmp_path).strip()  # fmt: skip
    # torch, grpc, ... from this environment, after the fresh one's own packages
    (Path(site) / "zz-project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = (
        "import importlib.metadata as md, kernels, transformers\n"
        "import tandem.kernels.reference, tandem.services.router.server\n"
        "from tandem.model.llama import LlamaModel\n"
        f"assert kernels.__file__.startswith({site!r}), kernels.__file__\n"
        f"assert transformers.__file__.startswith({site!r}), transformers.__file__\n"
        f"assert tandem.kernels.reference.__file__.startswith({site!r})\n"
        "print(md.version('transformers'), md.version('kernels'))\n"
    )
    versions = _run(python, "-c", probe, cwd=tmp_path).split()
    newest = _run(python, "-m", "pip", "index", "versions", "transformers", cwd=tmp_path)
    assert versions[0] == newest.split("(")[1].split(")")[0]  # "transformers (5.25.0)"
