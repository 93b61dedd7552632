"""The router process's config. Flags of `python -m services.router` (and the Helm chart's
`router.config` values, as TANDEM_* env) map 1:1 to the leaf fields, the placement policy's
included (`--cache-weight` sets `routing.cache_weight`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config import DEFAULT_BLOCK_SIZE
from tandem.routing import RoutingConfig


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Attributes:
    model_dir: the served model (the router reads its tokenizer and config only).
    model_id: name clients use; default: the directory name.
    host, port: where the public gRPC API listens.
    redis_url: worker registry and prefix index. Empty: use the static address lists.
    prefill_addresses, decode_addresses: static workers (tests, single-host setups).
    max_inflight: concurrent Generate calls before RESOURCE_EXHAUSTED.
    block_size: KV block size of the workers (prefix hashes are per block).
    worker_refresh_s: how often the registry is polled for joins, departures and load.
    index_timeout_s: how long a prefix-index lookup may take before the request is placed
        on load alone.
    routing: the placement policy's knobs (tandem.routing.RoutingConfig).
    """

    model_dir: str
    model_id: str = ""
    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str = ""
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    max_inflight: int = 256
    block_size: int = DEFAULT_BLOCK_SIZE
    worker_refresh_s: float = 0.5
    index_timeout_s: float = 0.05
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def __post_init__(self) -> None:
        if self.max_inflight <= 0:
            raise ValueError(f"max_inflight must be positive, got {self.max_inflight}")
        if not self.redis_url and not self.decode_addresses:
            raise ValueError("need redis_url or decode_addresses to find workers")
