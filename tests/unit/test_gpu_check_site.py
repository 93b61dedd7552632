"""What the GPU check carries covers what the engine and the services import.

The H200 check machine has no network: what it lacks travels in the archive that
`scripts/gpu-check-site` builds from its NAMES. The first run there failed at the first
engine import (llguidance and gguf had become dependencies since the archive was defined):
every distribution imported by loading the engine, the workers and the router must be on
the machine (`ON_MACHINE`, from GPU.md and its first run's environment) or in NAMES.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SITE_SCRIPT = REPO_ROOT / "scripts" / "gpu-check-site"
# What the check machine has (Python 3.12, torch 2.11 cu130, transformers 5.17): torch,
# triton, transformers and what they require, and the packages GPU.md lists.
ON_MACHINE = {
    "torch", "triton", "transformers", "huggingface-hub", "hf-xet", "tokenizers",
    "safetensors", "numpy", "jinja2", "markupsafe", "tqdm", "pyyaml", "regex", "requests",
    "urllib3", "idna", "certifi", "charset-normalizer", "filelock", "fsspec", "packaging",
    "sympy", "mpmath", "networkx", "typing-extensions", "setuptools", "prometheus-client",
    "pytest", "pluggy", "iniconfig", "pygments", "sniffio",
}  # fmt: skip
# Loading these is what a worker and the router do before serving (and the GPU check's
# parts import from them).
ENTRY_MODULES = (
    "tandem.engine",
    "tandem.weights.loader",
    "tandem.kernels.decode_attention",
    "tandem.services.prefill.__main__",
    "tandem.services.decode.__main__",
    "tandem.services.router.__main__",
)

# The distributions of the modules loaded: by top-level name, and for a namespace package
# that several distributions share (`opentelemetry`, `google`), by the files of the modules.
_PROBE = """
import importlib, json, sys
from importlib.metadata import distribution, packages_distributions
for name in sys.argv[1:]:
    importlib.import_module(name)
tops = packages_distributions()
files = {getattr(m, "__file__", None) for m in list(sys.modules.values())}
found = set()
for top in {m.split(".")[0] for m in sys.modules}:
    owners = tops.get(top, [])
    if len(owners) == 1:
        found.add(owners[0])
    for name in owners if len(owners) > 1 else ():
        dist = distribution(name)
        if any(str(dist.locate_file(f)) in files for f in dist.files or ()):
            found.add(name)
print(json.dumps(sorted(found)))
"""
# grpc probes for grpcio-tools (to compile protos at runtime) and does without it.
OPTIONAL = {"grpcio-tools"}


def site_names() -> set[str]:
    text = SITE_SCRIPT.read_text()
    match = re.search(r"^NAMES=\((.*?)\)", text, re.S | re.M)
    assert match, "scripts/gpu-check-site has no NAMES=( ... )"
    return {_normal(n) for n in match.group(1).split()}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_site_archive_covers_every_import_of_the_engine_and_services() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *ENTRY_MODULES],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {_normal(d) for d in json.loads(proc.stdout.strip().splitlines()[-1])}
    # The project itself is imported from the tree there, not installed.
    imported -= {"tandem"}
    assert {"torch", "grpcio", "llguidance"} <= imported  # the probe saw the real imports
    missing = imported - site_names() - ON_MACHINE - OPTIONAL
    assert not missing, (
        f"imported at load but neither on the GPU check machine nor in scripts/gpu-check-site's "
        f"NAMES: {sorted(missing)}"
    )
