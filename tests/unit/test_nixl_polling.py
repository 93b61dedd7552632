"""How a NIXL read waits for its transfer: polls back to back only yield the GIL for the
first millisecond, then sleep briefly, so a long pull leaves the GIL to the engine and
event-loop threads (issue 22). A fake agent stands in for NIXL; time is a fake clock."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")

from tandem.transfer import nixl as nixl_transport  # noqa: E402
from tandem.transfer.nixl import POLL_SLEEP_S, NixlTransport, poll_pause_s  # noqa: E402


def test_poll_pause_yields_first_then_sleeps() -> None:
    assert poll_pause_s(0.0) == 0.0
    assert poll_pause_s(0.000999) == 0.0
    assert poll_pause_s(0.001) == POLL_SLEEP_S == 0.0002
    assert poll_pause_s(5.0) == POLL_SLEEP_S


class FakeAgent:
    """A transfer that stays in PROC for `polls` checks, then is DONE."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def transfer(self, handle: object) -> str:
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        self.polls -= 1
        return "PROC" if self.polls > 0 else "DONE"


def test_wait_pauses_by_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += max(seconds, 0.0004)  # each poll takes 0.4 ms of the fake clock

    monkeypatch.setattr(nixl_transport.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(nixl_transport.time, "sleep", sleep)
    transport = object.__new__(NixlTransport)  # no native agent: only _wait runs
    transport._closed = False
    transport._agent = FakeAgent(polls=5)  # type: ignore[assignment]
    transport._wait(object(), "owner", deadline=200.0, timeout_s=100.0)  # type: ignore[arg-type]
    # 0, 0.4, 0.8 ms: yield only; from 1.2 ms on: sleep.
    assert pauses == [0.0, 0.0, 0.0, POLL_SLEEP_S, POLL_SLEEP_S]
