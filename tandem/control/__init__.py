"""Pure P:D ratio policy: decide(observation, config, state) -> (Decision, state).

Modules: `config` (SLA, ControlConfig), `samples` (what is observed), `window` (the sliding
window of samples), `model` (the fitted capacity of workers), `policy` (decide: the model's
wants through the guards)."""

from tandem.control.config import ROLES, SLA, ControlConfig
from tandem.control.model import (
    DecodeFit,
    PrefillFit,
    decode_token_demand,
    decode_token_rate,
    decode_workers_for,
    fit_decode,
    fit_decode_step,
    fit_prefill,
    workers_for,
)
from tandem.control.policy import ControlState, Decision, decide
from tandem.control.samples import Observation, RequestSample, WorkerSample, percentile
from tandem.control.window import SampleWindow

__all__ = [
    "ROLES",
    "SLA",
    "ControlConfig",
    "ControlState",
    "DecodeFit",
    "Decision",
    "Observation",
    "PrefillFit",
    "RequestSample",
    "SampleWindow",
    "WorkerSample",
    "decide",
    "decode_token_demand",
    "decode_token_rate",
    "decode_workers_for",
    "fit_decode",
    "fit_decode_step",
    "fit_prefill",
    "percentile",
    "workers_for",
]
