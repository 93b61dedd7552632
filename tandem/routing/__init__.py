"""Pure placement policy: choose(request, workers, config) -> Placement."""

from tandem.routing.inflight import Dispatch, InflightLoad
from tandem.routing.policy import (
    POLICIES,
    Placement,
    RouteRequest,
    RoutingConfig,
    WorkerLoad,
    choose,
    prefix_key,
)

__all__ = [
    "POLICIES",
    "Dispatch",
    "InflightLoad",
    "Placement",
    "RouteRequest",
    "RoutingConfig",
    "WorkerLoad",
    "choose",
    "prefix_key",
]
