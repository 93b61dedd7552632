"""The controller's Prometheus /metrics: replica counts, SLA attainment and decisions."""

from __future__ import annotations

from tandem.control import Decision
from tandem.types import Role
from tandem.v1 import admin_pb2 as apb


class ControllerMetrics:
    """Prometheus /metrics: replica counts, SLA attainment and decisions."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.replicas = Gauge(
            "tandem_controller_replicas",
            "Workers per role: current (asked for), desired (last decision), live.",
            ["role", "kind"],
            registry=self.registry,
        )
        self.attainment = Gauge(
            "tandem_controller_sla_attainment",
            "Fraction of the window's requests that met both SLA targets.",
            registry=self.registry,
        )
        self.decisions = Counter(
            "tandem_controller_decisions",
            "Decisions that changed a role's replica count.",
            ["role", "applied"],
            registry=self.registry,
        )
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)

    def update(self, status: apb.StatusResponse, decision: Decision, applied: bool) -> None:
        """After a tick: the status it left and its decision (applied: the actuator took it)."""
        for r in status.roles:
            self.replicas.labels(r.role, "current").set(r.current)
            self.replicas.labels(r.role, "desired").set(r.desired)
            self.replicas.labels(r.role, "live").set(r.live)
        self.attainment.set(status.sla_attainment)
        for role in Role:
            if decision.current[role] != decision.target[role]:
                self.decisions.labels(role, str(applied).lower()).inc()

    def close(self) -> None:
        self._server.shutdown()
