"""A worker process's configuration: its engine, plus what the process around it needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config import EngineConfig
from tandem.services.common.security import AuthConfig
from tandem.transfer import TRANSPORT_KINDS


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker process: its engine, plus what the process around it needs. Flags of
    `python -m tandem.services.{prefill,decode}` map 1:1 to the leaf fields
    (`tandem.services.common.runtime.flags`: `--kv-cache-bytes` sets `engine.cache.kv_cache_bytes`);
    the engine's role is the service's, not a flag.

    Attributes:
        engine: model, dtype, device, KV cache and scheduler (tandem.config.EngineConfig).
        worker_id: unique name (also the NIXL agent name); default role-pid.
        host, port: where the gRPC server listens (port 0: any free port).
        metrics_port: Prometheus /metrics over HTTP on `host`
        (tandem.services.common.observe.metrics); -1:
            off, 0: any free port (logged).
        advertise_host: host put in the registry (default: host).
        redis_url: registry; empty = do not register (tests that dial workers directly).
        transport: KV transport, "nixl" or "local".
        lease_ttl_s: prefill: how long handed-off blocks stay pinned awaiting the reader.
        kv_wait_s: decode: how long a hand-off may wait for free blocks before
            RESOURCE_EXHAUSTED.
        heartbeat_interval_s, registry_ttl_s: how often the worker reports its load, and
            how long the registry keeps it without a report.
        drain_timeout_s: on SIGTERM, how long to let in-flight requests finish.
        max_queued_requests: requests admitted but not yet running in the engine before new
            ones get RESOURCE_EXHAUSTED with a retry hint (the router then tries later or
            elsewhere).
        auth: the internal plane's credentials (tandem.services.common.security.AuthConfig).
        otlp_endpoint: OTLP gRPC collector for traces (e.g. http://collector:4317); empty:
            the OTEL_EXPORTER_OTLP_ENDPOINT variable, or no tracing
            (tandem.services.common.observe.tracing).
        progress_interval_s: a request without output for this long gets a progress message
            (queue position, tokens computed, engine steps) on its Prefill or Decode stream,
            so the router tells a busy worker from a stalled one (tandem.routing.stall).
        orphan_grace_s: a request that holds KV blocks with neither a call nor a lease for
            this long is reaped: aborted, its blocks freed, counted and logged
            (tandem.engine.orphans). The safety net under a lost abort.
        kv_audit_strict: every second, check the block pool's reference counts against the
            live requests, and count each failure and each reap as a violation
            (tandem_worker_kv_audit_violations_total, logged as errors). On in tests.
    """

    engine: EngineConfig
    worker_id: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = -1
    advertise_host: str = ""
    redis_url: str = ""
    transport: str = "nixl"
    lease_ttl_s: float = 10.0
    kv_wait_s: float = 10.0
    heartbeat_interval_s: float = 0.5
    registry_ttl_s: float = 3.0
    drain_timeout_s: float = 30.0
    max_queued_requests: int = 256
    auth: AuthConfig = field(default_factory=AuthConfig)
    otlp_endpoint: str = ""
    progress_interval_s: float = 1.0
    orphan_grace_s: float = 5.0
    kv_audit_strict: bool = False

    def __post_init__(self) -> None:
        if self.max_queued_requests <= 0:
            raise ValueError(
                f"max_queued_requests must be positive, got {self.max_queued_requests}"
            )
        if self.metrics_port < -1:
            raise ValueError(f"metrics_port must be >= -1 (-1: off), got {self.metrics_port}")
        if self.transport not in TRANSPORT_KINDS:
            raise ValueError(f"transport must be one of {TRANSPORT_KINDS}, got {self.transport!r}")
        for name in (
            "lease_ttl_s", "kv_wait_s", "heartbeat_interval_s", "registry_ttl_s",
            "progress_interval_s", "orphan_grace_s",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
