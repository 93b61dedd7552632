"""Discrete-event simulator of a Tandem cluster that runs the real routing and ratio
policies: simulate(trace, cost, config) -> SimResult."""

from tandem.sim.cluster import SimConfig, simulate
from tandem.sim.cost import (
    COST_MODELS,
    H100,
    H200,
    LLAMA_8B,
    QWEN3_30B_A3B,
    CostModel,
    CpuFittedCost,
    GpuSpec,
    ModelSpec,
    RooflineCost,
    cost_model,
)
from tandem.sim.results import RequestRecord, SeriesPoint, SimResult, Summary
from tandem.sim.trace import (
    TRACES,
    Burst,
    Phase,
    RequestClass,
    TraceRequest,
    TraceSpec,
    generate,
    preset,
)

__all__ = [
    "COST_MODELS",
    "H100",
    "H200",
    "LLAMA_8B",
    "QWEN3_30B_A3B",
    "TRACES",
    "Burst",
    "CostModel",
    "CpuFittedCost",
    "GpuSpec",
    "ModelSpec",
    "Phase",
    "RequestClass",
    "RequestRecord",
    "RooflineCost",
    "SeriesPoint",
    "SimConfig",
    "SimResult",
    "Summary",
    "TraceRequest",
    "TraceSpec",
    "cost_model",
    "generate",
    "preset",
    "simulate",
]
