"""The router process's config. Flags of `python -m tandem.services.router` (and the Helm chart's
`router.config` values, as TANDEM_* env) map 1:1 to the leaf fields, the placement policy's
included (`--cache-weight` sets `routing.cache_weight`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config import DEFAULT_BLOCK_SIZE
from tandem.routing import RoutingConfig
from tandem.routing.health import BreakerConfig
from tandem.routing.recovery import RecoveryConfig
from tandem.services.common.security import AuthConfig
from tandem.tools import get_format

DEFAULT_MAX_QUEUE_DELAY_S = 120.0


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Attributes:
    model_dir: the served model (the router reads its tokenizer and config only).
    model_id: name clients use; default: the directory name.
    host, port: where the public gRPC API listens.
    http_port: the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
        /v1/models, /health; tandem.services.router.openai.http) on `host`, with the same keys and
        TLS as the gRPC API; -1: off, 0: any free port (logged).
    metrics_port: Prometheus /metrics over HTTP on `host` (tandem.services.common.observe.metrics);
        -1: off, 0: any free port (logged).
    redis_url: worker registry and prefix index. Empty: use the static address lists.
    prefill_addresses, decode_addresses: static workers (tests, single-host setups).
    max_inflight: concurrent Generate calls before RESOURCE_EXHAUSTED.
    block_size: KV block size of the workers (prefix hashes are per block).
    worker_refresh_s: how often the registry is polled for joins, departures and load.
    index_timeout_s: how long a prefix-index lookup may take before the request is placed
        on load alone.
    hop_timeout_s: longest a Prefill or Decode hop may go without progress before the
        router counts the worker as stalled and recovers the request elsewhere. Progress is
        any output, or a worker's progress report showing its engine stepping, the
        request's queue position dropping or its computed tokens growing
        (tandem.routing.stall): a busy worker never stalls, however long its queue. What is
        left to find this way is an engine hung inside a step, so the default is generous
        (one prefill step of a whole token budget on an oversubscribed CPU took over 30 s):
        a dead or frozen process is found within ~2 s by keepalive.
    max_queue_delay_s: refuse a request at once (RESOURCE_EXHAUSTED, HTTP 429, with a
        retry hint) when its expected wait for the first token -- the prefilling worker's
        queued prompt tokens at its measured prefill rate (tandem.routing.admission) --
        exceeds this; 0: no limit. 120 s: the 8-client soak of the default model on 2 cores
        (benchmarks/bench_soak.py) has document TTFTs up to ~64 s, all of which are served;
        at 60 s a third of its documents were refused.
    keepalive_s: gRPC keepalive ping interval (and timeout) on worker channels: a frozen or
        unreachable worker fails its calls within about twice this.
    request_id_ttl_s: how long a claimed client request id stays claimed in Redis when the
        call has no deadline (bounds what a crashed router leaves behind).
    api_keys_file: the public API's keys (tandem.services.common.security.KeyRing: one
        `<key> <tenant> [scopes]` per line). Set: every call needs `authorization: Bearer
        <key>` with scope "generate", and each tenant's prompts are cached apart (a per-tenant
        salt in the prefix hashes) unless listed in shared_cache_tenants. Empty: no keys
        (loopback development), one shared cache.
    tls_cert_file, tls_key_file: serve the public API over TLS with this certificate.
    shared_cache_tenants: comma-separated tenants whose prompts share one prefix cache (with
        each other and with keyless calls), e.g. several keys of one application.
    routing: the placement policy's knobs (tandem.routing.RoutingConfig).
    recovery: the per-request retry budget and fallbacks (tandem.routing.recovery).
    breaker: per-worker circuit breakers from RPC outcomes (tandem.routing.health).
    auth: the internal plane's credentials (tandem.services.common.security.AuthConfig).
    otlp_endpoint: OTLP gRPC collector for traces (e.g. http://collector:4317); empty: the
        OTEL_EXPORTER_OTLP_ENDPOINT variable, or no tracing
        (tandem.services.common.observe.tracing).
    tool_call_parser: how the model writes tool calls (tandem.tools): hermes, llama3_json,
        mistral, or auto (what the chat template shows; hermes when it shows none).
    """

    model_dir: str
    model_id: str = ""
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = -1
    metrics_port: int = -1
    redis_url: str = ""
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    max_inflight: int = 256
    block_size: int = DEFAULT_BLOCK_SIZE
    worker_refresh_s: float = 0.5
    index_timeout_s: float = 0.05
    hop_timeout_s: float = 120.0
    max_queue_delay_s: float = DEFAULT_MAX_QUEUE_DELAY_S
    keepalive_s: float = 1.0
    request_id_ttl_s: float = 3600.0
    api_keys_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    shared_cache_tenants: str = ""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    otlp_endpoint: str = ""
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.max_inflight <= 0:
            raise ValueError(f"max_inflight must be positive, got {self.max_inflight}")
        if self.http_port < -1:
            raise ValueError(f"http_port must be >= -1 (-1: off), got {self.http_port}")
        if self.metrics_port < -1:
            raise ValueError(f"metrics_port must be >= -1 (-1: off), got {self.metrics_port}")
        if self.max_queue_delay_s < 0:
            raise ValueError(f"max_queue_delay_s must be >= 0, got {self.max_queue_delay_s}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs tls_cert_file and tls_key_file together")
        for name in ("hop_timeout_s", "keepalive_s", "request_id_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.tool_call_parser != "auto":
            get_format(self.tool_call_parser)  # ValueError naming the formats
        if not self.redis_url and not self.decode_addresses:
            raise ValueError("need redis_url or decode_addresses to find workers")
