"""Pure placement policy: choose(request, workers, config) -> Placement."""

from tandem.routing.inflight import Dispatch, InflightLoad
from tandem.routing.policy import (
    POLICIES,
    Candidate,
    Placement,
    RouteKind,
    RouteRequest,
    RoutingConfig,
    WorkerLoad,
    choose,
    prefix_key,
    weigh,
)
from tandem.routing.tiers import TierCost, TierOverlap, tier_cost

__all__ = [
    "POLICIES",
    "Candidate",
    "Dispatch",
    "InflightLoad",
    "Placement",
    "RouteKind",
    "RouteRequest",
    "RoutingConfig",
    "TierCost",
    "TierOverlap",
    "WorkerLoad",
    "choose",
    "prefix_key",
    "tier_cost",
    "weigh",
]
