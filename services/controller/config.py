"""The controller process's config. Flags of `python -m services.controller` (and the Helm
chart's `controller.config` values, as TANDEM_* env) map 1:1 to fields."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tandem.control import SLA, ControlConfig

ACTUATORS = ("kubernetes", "local", "none")


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Attributes:
    redis_url: where workers heartbeat their stats and routers publish request timings.
    model_id: only count workers serving this model; empty = all.
    host, port: the admin gRPC API (tandem.v1.Admin; `tandem ctl` talks to it).
    metrics_port: Prometheus /metrics over HTTP on `host`; 0 = off.
    actuator: "kubernetes" (patch the Deployments' scale subresource), "local" (tandem up
        --autoscale starts/stops processes) or "none" (decide and report only).
    namespace, prefill_deployment, decode_deployment: the Deployments it scales.
    kubeconfig: path of a kubeconfig; empty = in-cluster service-account credentials.
    interval_s: how often it decides. window_s: how much history each decision sees.
    ttft_p90_ms, itl_p90_ms: SLA targets (tunable at run time with `tandem ctl set-sla`).
    The rest are tandem.control.ControlConfig fields of the same names.
    """

    redis_url: str = ""
    model_id: str = ""
    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = 9090
    actuator: str = "none"
    namespace: str = "default"
    prefill_deployment: str = "tandem-prefill"
    decode_deployment: str = "tandem-decode"
    kubeconfig: str = ""
    interval_s: float = 5.0
    window_s: float = 60.0
    ttft_p90_ms: float = 2000.0
    itl_p90_ms: float = 200.0
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    target_utilization: float = 0.7
    hysteresis: float = 0.2
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    scale_down_stable_s: float = 60.0
    max_step: int = 2
    min_requests: int = 20
    prefill_backlog_s: float = 0.0
    decode_backlog_s: float = 0.0
    max_down_step: int = 1

    def __post_init__(self) -> None:
        if self.actuator not in ACTUATORS:
            raise ValueError(f"actuator must be one of {ACTUATORS}, got {self.actuator!r}")
        if self.interval_s <= 0 or self.window_s < self.interval_s:
            raise ValueError(
                f"need interval_s > 0 and window_s >= interval_s, got {self.interval_s}, "
                f"{self.window_s}"
            )
        _ = self.control, self.sla  # validates those fields

    @property
    def control(self) -> ControlConfig:
        """The policy's knobs: every ControlConfig field has a flag of the same name here."""
        return ControlConfig(**{f.name: getattr(self, f.name) for f in fields(ControlConfig)})

    @property
    def sla(self) -> SLA:
        return SLA(ttft_p90_ms=self.ttft_p90_ms, itl_p90_ms=self.itl_p90_ms)
