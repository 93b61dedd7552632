"""tandem.services.common.rpc.healthcheck (the chart's exec probe on Kubernetes < 1.24) against a
real
gRPC server with grpc_health's HealthServicer."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.services.common.rpc.healthcheck import check, main

REPO = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _StuckHealth(health_pb2_grpc.HealthServicer):
    """Answers no Check until released: the probe must give up at its own deadline."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Check(self, request: Any, context: Any) -> Any:
        self.release.wait(timeout=30)
        return health_pb2.HealthCheckResponse(status=SERVING)


def _serve(servicer: Any) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.fixture(scope="module")
def health_server() -> Iterator[tuple[health.HealthServicer, int]]:
    servicer = health.HealthServicer()
    servicer.set("", SERVING)
    servicer.set("tandem.v1.Router", NOT_SERVING)
    server, port = _serve(servicer)
    yield servicer, port
    server.stop(grace=None)


def test_module_exits_zero_when_serving(health_server: tuple[Any, int]) -> None:
    _, port = health_server
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.services.common.rpc.healthcheck", "--port", str(port)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"127.0.0.1:{port} service '': SERVING"


def test_not_serving_service_exits_one(
    health_server: tuple[Any, int], capsys: pytest.CaptureFixture[str]
) -> None:
    _, port = health_server
    assert main(["--port", str(port), "--service", "tandem.v1.Router"]) == 1
    assert capsys.readouterr().out.strip().endswith("'tandem.v1.Router': NOT_SERVING")


def test_status_change_is_seen(health_server: tuple[health.HealthServicer, int]) -> None:
    servicer, port = health_server
    servicer.set("draining", SERVING)
    assert check(port, service="draining").serving
    servicer.set("draining", NOT_SERVING)  # what a worker reports once SIGTERM arrives
    assert check(port, service="draining") == (
        False,
        f"127.0.0.1:{port} service 'draining': NOT_SERVING",
    )


def test_unknown_service_exits_one(
    health_server: tuple[Any, int], capsys: pytest.CaptureFixture[str]
) -> None:
    _, port = health_server
    assert main(["--port", str(port), "--service", "no.such.Service"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().out


def test_no_server_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["--port", str(port), "--timeout-s", "5"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out


def test_deadline_bounds_a_stuck_server(capsys: pytest.CaptureFixture[str]) -> None:
    servicer = _StuckHealth()
    server, port = _serve(servicer)
    try:
        assert main(["--port", str(port), "--timeout-s", "0.3"]) == 1
        assert "DEADLINE_EXCEEDED" in capsys.readouterr().out
    finally:
        servicer.release.set()
        server.stop(grace=None)


@pytest.mark.parametrize(
    "argv",
    [["--port", "0"], ["--port", "70000"], ["--port", "50051", "--timeout-s", "0"], []],
)
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
