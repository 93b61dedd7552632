"""The generated code in tandem/v1 is exactly what protos/generate.py produces today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path) -> None:
    # In a subprocess: grpc_tools' bundled protobuf and NIXL's libraries crash when both are
    # loaded into one process, and other tests load NIXL.
    run = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    fresh = sorted((tmp_path / "tandem" / "v1").glob("*_pb2*.py*"))
    assert {p.name for p in fresh} >= {"router_pb2.py", "worker_pb2_grpc.py"}
    for path in fresh:
        committed = ROOT / "tandem" / "v1" / path.name
        assert committed.is_file(), f"{committed} is missing: run python protos/generate.py"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed} is stale: run python protos/generate.py"
        )


def test_service_names() -> None:
    from tandem.v1 import router_pb2, worker_pb2

    services = set(router_pb2.DESCRIPTOR.services_by_name) | set(
        worker_pb2.DESCRIPTOR.services_by_name
    )
    assert services == {"Router", "PrefillWorker", "DecodeWorker"}
    assert router_pb2.DESCRIPTOR.package == "tandem.v1"
