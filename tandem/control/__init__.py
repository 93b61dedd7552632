"""Pure P:D ratio policy: decide(observation, config, state) -> (Decision, state).

Modules: `config` (SLA, ControlConfig), `samples` (what is observed), `window` (the sliding
window of samples), `model` (the fitted capacity of workers), `trial` (a scale-up kept only if
it raised goodput), `capacity` (how many workers one host holds), `policy` (decide: the
model's wants through the guards)."""

from tandem.control.capacity import HostCapacity, host_capacity
from tandem.control.config import SLA, ControlConfig
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
from tandem.control.trial import Goodput, Hold, Trial, Verdict, goodput, improved, judge
from tandem.control.window import SampleWindow

__all__ = [
    "SLA",
    "ControlConfig",
    "ControlState",
    "DecodeFit",
    "Decision",
    "Goodput",
    "Hold",
    "HostCapacity",
    "Observation",
    "PrefillFit",
    "RequestSample",
    "SampleWindow",
    "Trial",
    "Verdict",
    "WorkerSample",
    "decide",
    "decode_token_demand",
    "decode_token_rate",
    "decode_workers_for",
    "fit_decode",
    "fit_decode_step",
    "fit_prefill",
    "goodput",
    "host_capacity",
    "improved",
    "judge",
    "percentile",
    "workers_for",
]
