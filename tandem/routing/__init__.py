"""Pure placement policy: choose(request, workers, config) -> Placement."""

from tandem.routing.policy import (
    POLICIES,
    Placement,
    RouteRequest,
    RoutingConfig,
    WorkerLoad,
    choose,
)

__all__ = ["POLICIES", "Placement", "RouteRequest", "RoutingConfig", "WorkerLoad", "choose"]
