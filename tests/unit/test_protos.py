"""The generated code in tandem/v1 is exactly what protos/generate.py produces today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = module.generate(tmp_path)
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
