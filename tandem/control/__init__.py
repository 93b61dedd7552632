"""Pure P:D ratio policy: decide(observation, config, state) -> (Decision, state)."""

from tandem.control.policy import (
    ROLES,
    SLA,
    ControlConfig,
    ControlState,
    Decision,
    Observation,
    RequestSample,
    WorkerSample,
    decide,
    percentile,
)

__all__ = [
    "ROLES",
    "SLA",
    "ControlConfig",
    "ControlState",
    "Decision",
    "Observation",
    "RequestSample",
    "WorkerSample",
    "decide",
    "percentile",
]
