"""The controller process's config. Flags of `python -m tandem.services.controller` (and the Helm
chart's `controller.config` values, as TANDEM_* env) map 1:1 to leaf fields: the nested
`sla` and `control` configs are flattened by tandem.services.common.runtime.flags (`--ttft-p90-ms`,
`--max-prefill`, TANDEM_MAX_PREFILL, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.control import SLA, ControlConfig
from tandem.services.common.security import AuthConfig

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
    sla: the SLA targets at start (tunable at run time with `tandem ctl set-sla`).
    control: the policy's knobs.
    auth: the internal plane's credentials (tandem.services.common.security.AuthConfig).
    admin_keys_file: the admin API's keys (tandem.services.common.security.KeyRing: one
        `<key> <tenant> [scopes]` per line). Set: SetRatio, SetSla and Auto need a key with
        scope "admin"; Status and Explain one with "admin" or "read" (`tandem ctl
        --admin-key-file`, or TANDEM_ADMIN_KEY). Empty: the admin API takes calls without a
        key (keep its port private).
    otlp_endpoint: OTLP gRPC collector for traces; empty: OTEL_EXPORTER_OTLP_ENDPOINT, or
        none (tandem.services.common.observe.tracing; the controller itself records no spans yet).
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
    sla: SLA = field(default_factory=SLA)
    control: ControlConfig = field(default_factory=ControlConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    admin_keys_file: str = ""
    otlp_endpoint: str = ""

    def __post_init__(self) -> None:
        if self.actuator not in ACTUATORS:
            raise ValueError(f"actuator must be one of {ACTUATORS}, got {self.actuator!r}")
        if self.interval_s <= 0 or self.window_s < self.interval_s:
            raise ValueError(
                f"need interval_s > 0 and window_s >= interval_s, got {self.interval_s}, "
                f"{self.window_s}"
            )
