"""Regenerate the Python code for protos/tandem/v1/*.proto into tandem/v1/.

Usage: python protos/generate.py [OUT_DIR]   (default: the repository root)
tests/unit/test_protos.py regenerates into a temporary directory and checks that the
committed files are current.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    sources = sorted((PROTO_DIR / "tandem" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(s.relative_to(PROTO_DIR)) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "tandem" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for path in generate(out):
        print(path.relative_to(out))
