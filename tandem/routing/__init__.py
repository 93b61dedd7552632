"""Pure placement policy: choose(request, snapshot) -> Placement."""

from tandem.routing.policy import Placement, RoutingConfig, WorkerLoad, choose

__all__ = ["Placement", "RoutingConfig", "WorkerLoad", "choose"]
