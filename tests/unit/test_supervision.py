"""The restart policy of `tandem up`'s supervisor: exact delays, attempts and give-up points."""

from __future__ import annotations

import pytest

from tandem.services.common.runtime.supervision import (
    GiveUp,
    Restart,
    RestartConfig,
    RestartPolicy,
    describe_exit,
)


def policy(**overrides: float) -> RestartPolicy:
    return RestartPolicy(RestartConfig(**overrides))  # type: ignore[arg-type]


def test_describe_exit_names_the_signal_or_the_status() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(-11) == "killed by SIGSEGV"
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(0) == "exited with status 0"
    assert describe_exit(1) == "exited with status 1"
    assert describe_exit(-99) == "killed by signal 99"  # no such signal on Linux


def test_backoff_doubles_from_the_base_and_stops_at_the_cap() -> None:
    p = policy(backoff_s=0.5, max_backoff_s=8.0, max_restarts=10, window_s=1000.0)
    decisions = [p.on_exit("decode-0", float(t)) for t in range(8)]
    assert decisions == [
        Restart(0.5, 1),
        Restart(1.0, 2),
        Restart(2.0, 3),
        Restart(4.0, 4),
        Restart(8.0, 5),
        Restart(8.0, 6),
        Restart(8.0, 7),
        Restart(8.0, 8),
    ]


def test_a_cap_that_is_not_a_power_of_two_of_the_base_is_still_the_cap() -> None:
    p = policy(backoff_s=1.0, max_backoff_s=3.0, max_restarts=10, window_s=1000.0)
    assert [p.on_exit("r", float(t)).delay_s for t in range(4)] == [1.0, 2.0, 3.0, 3.0]  # type: ignore[union-attr]


def test_gives_up_on_the_exit_after_max_restarts_within_the_window() -> None:
    p = policy(backoff_s=0.5, max_backoff_s=8.0, max_restarts=3, window_s=60.0)
    assert p.on_exit("decode-0", 0.0) == Restart(0.5, 1)
    assert p.on_exit("decode-0", 1.0) == Restart(1.0, 2)
    assert p.on_exit("decode-0", 2.0) == Restart(2.0, 3)
    assert p.on_exit("decode-0", 3.0) == GiveUp("4 exits within 60 s (at most 3 restarts allowed)")


def test_zero_max_restarts_gives_up_on_the_first_exit() -> None:
    p = policy(max_restarts=0)
    assert p.on_exit("redis", 5.0) == GiveUp("1 exits within 60 s (at most 0 restarts allowed)")


def test_the_window_slides_and_an_exit_exactly_window_s_old_no_longer_counts() -> None:
    p = policy(backoff_s=1.0, max_backoff_s=100.0, max_restarts=2, window_s=10.0)
    assert p.on_exit("router", 0.0) == Restart(1.0, 1)
    assert p.on_exit("router", 5.0) == Restart(2.0, 2)
    # (0, 10]: the exit at 0 has left the window, so this is the 2nd exit in it, not the 3rd.
    assert p.on_exit("router", 10.0) == Restart(2.0, 3)
    # (2, 12] holds 5, 10 and 12: a window that reset at 10 (tumbling) would see only two.
    assert isinstance(p.on_exit("router", 12.0), GiveUp)


def test_backoff_starts_over_after_a_quiet_window_but_attempts_keep_counting() -> None:
    p = policy(backoff_s=0.5, max_backoff_s=8.0, max_restarts=5, window_s=60.0)
    assert p.on_exit("prefill-0", 0.0) == Restart(0.5, 1)
    assert p.on_exit("prefill-0", 1.0) == Restart(1.0, 2)
    assert p.on_exit("prefill-0", 2.0) == Restart(2.0, 3)
    assert p.on_exit("prefill-0", 100.0) == Restart(0.5, 4)


def test_children_are_counted_separately() -> None:
    p = policy(backoff_s=0.5, max_backoff_s=8.0, max_restarts=2, window_s=60.0)
    assert p.on_exit("decode-0", 0.0) == Restart(0.5, 1)
    assert p.on_exit("decode-0", 1.0) == Restart(1.0, 2)
    assert p.on_exit("decode-1", 2.0) == Restart(0.5, 1)
    assert isinstance(p.on_exit("decode-0", 3.0), GiveUp)
    assert p.on_exit("decode-1", 4.0) == Restart(1.0, 2)


def test_forget_clears_the_history_of_one_child_only() -> None:
    p = policy(backoff_s=0.5, max_backoff_s=8.0, max_restarts=1, window_s=60.0)
    assert p.on_exit("decode-0", 0.0) == Restart(0.5, 1)
    assert p.on_exit("decode-1", 0.0) == Restart(0.5, 1)
    p.forget("decode-0")
    p.forget("never-seen")  # a no-op
    assert p.on_exit("decode-0", 1.0) == Restart(0.5, 1)
    assert isinstance(p.on_exit("decode-1", 1.0), GiveUp)


def test_time_going_backwards_is_misuse() -> None:
    p = policy()
    p.on_exit("redis", 10.0)
    with pytest.raises(ValueError, match="earlier than the last one"):
        p.on_exit("redis", 9.0)
    assert p.on_exit("redis", 10.0) == Restart(1.0, 2)  # the same instant is fine


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(backoff_s=0.0), "backoff_s"),
        (dict(backoff_s=10.0, max_backoff_s=8.0), "backoff_s <= max_backoff_s"),
        (dict(max_restarts=-1), "max_restarts"),
        (dict(window_s=0.0), "window_s"),
    ],
)
def test_config_rejects_nonsense(bad: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RestartConfig(**bad)  # type: ignore[arg-type]
