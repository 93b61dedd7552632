"""`python -m tandem.services.common.rpc.healthcheck --port N`: a grpc.health.v1 probe for
Kubernetes.

Kubernetes >= 1.24 probes gRPC health natively; the Helm chart execs this module on older
clusters. It sends one Health/Check to 127.0.0.1:N and exits 0 when the answer is SERVING,
1 otherwise (NOT_SERVING, unknown service, no server, deadline), printing one line the
kubelet records in the pod's events.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class CheckResult(NamedTuple):
    serving: bool
    message: str


def check(
    port: int, host: str = "127.0.0.1", service: str = "", timeout_s: float = 2.0
) -> CheckResult:
    """One Health/Check call, bounded by `timeout_s` (connecting included)."""
    target = f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            name = code.name if code is not None else "ERROR"
            return CheckResult(False, f"{target} service {service!r}: {name}: {details}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    return CheckResult(serving, f"{target} service {service!r}: {status}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.services.common.rpc.healthcheck", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--port", type=int, required=True, help="the server's gRPC port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--service", default="", help='service name; "" = the whole server')
    parser.add_argument("--timeout-s", type=float, default=2.0, help="deadline of the call")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be positive, got {args.timeout_s}")
    result = check(args.port, args.host, args.service, args.timeout_s)
    print(result.message, flush=True)
    return 0 if result.serving else 1


if __name__ == "__main__":
    sys.exit(main())
