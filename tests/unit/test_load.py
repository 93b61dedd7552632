"""tandem/load.py: one load record, carried whole from the engine to the registry, placement
and the controller."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.control.samples import WorkerSample
from tandem.load import COUNT_FIELDS, LOAD_FIELDS, RATE_FIELDS, Load, check_load, load_fields
from tandem.routing import WorkerLoad
from tandem.services.common.redis.worker_info import WorkerInfo
from tandem.services.controller.server import sample_of

# every figure a different value, so a field copied into the wrong one shows
FULL = Load(
    num_running=3, num_waiting=5, queued_prefill_tokens=700, num_blocks=512,
    num_free_blocks=100, num_handed_off=2, num_preemptions=9, host_tier_blocks=40,
    disk_tier_blocks=300, tier_hit_tokens=6400, busy_frac=0.25,
    tokens_per_s=1500.5, step_ms=12.5, prefill_tokens_per_s=4000.0,
    host_onload_tokens_per_s=90000.0, disk_onload_tokens_per_s=20000.0,
)  # fmt: skip


def test_the_fields_are_the_counts_then_the_rates() -> None:
    assert LOAD_FIELDS == COUNT_FIELDS + RATE_FIELDS
    assert len(set(dataclasses.astuple(FULL))) == len(LOAD_FIELDS)


def test_every_carrier_is_a_load_and_copies_all_of_it() -> None:
    info = WorkerInfo(
        **load_fields(FULL), worker_id="d0", role="decode", address="h:1", model="m", epoch=7
    )
    assert load_fields(info) == load_fields(FULL)
    view = info.load()  # what placement sees
    assert isinstance(view, WorkerLoad) and load_fields(view) == load_fields(FULL)
    assert (view.worker_id, view.address, view.inflight_requests) == ("d0", "h:1", 0)
    sample = sample_of(dataclasses.replace(info, draining=True), 42.0)
    assert isinstance(sample, WorkerSample) and load_fields(sample) == load_fields(FULL)
    assert (sample.t, sample.worker_id, sample.role, sample.draining) == (
        42.0,
        "d0",
        "decode",
        True,
    )


def test_a_registry_record_round_trips_its_load_through_json() -> None:
    info = WorkerInfo(
        **load_fields(FULL), worker_id="p0", role="prefill", address="h:2", model="m", epoch=1
    )
    back = WorkerInfo.from_json(info.to_json())
    assert back == info and load_fields(back) == load_fields(FULL)
    # a record from a worker that predates num_handed_off / num_preemptions still reads
    old = info.to_json().replace('"num_handed_off":2,', "").replace('"num_preemptions":9,', "")
    assert load_fields(WorkerInfo.from_json(old))["num_handed_off"] == 0
    # and one that predates the tier counts: 0, as from a worker without tiers
    old = info.to_json()
    for name in ("host_tier_blocks", "disk_tier_blocks", "tier_hit_tokens"):
        old = old.replace(f'"{name}":{getattr(FULL, name)},', "")
    back = WorkerInfo.from_json(old)
    assert (back.host_tier_blocks, back.disk_tier_blocks, back.tier_hit_tokens) == (0, 0, 0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_running", -1, "WorkerInfo.num_running must be >= 0, got -1"),
        ("num_free_blocks", True, "WorkerInfo.num_free_blocks must be an int, got True"),
        ("num_preemptions", 1.5, "WorkerInfo.num_preemptions must be an int, got 1.5"),
        ("tier_hit_tokens", -5, "WorkerInfo.tier_hit_tokens must be >= 0, got -5"),
        ("busy_frac", -0.1, "WorkerInfo.busy_frac must be a number >= 0, got -0.1"),
        ("step_ms", "3", "WorkerInfo.step_ms must be a number >= 0, got '3'"),
    ],
)
def test_a_record_from_outside_is_checked_field_by_field(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_load(dataclasses.replace(FULL, **{field: value}), "WorkerInfo")
    with pytest.raises(ValueError, match=f"^{message}$"):
        WorkerInfo(worker_id="w", role="decode", address="a", model="m", epoch=1, **{field: value})
    check_load(FULL, "WorkerInfo")  # the valid record passes
