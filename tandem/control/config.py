"""The policy's configuration: the latency targets (SLA) and the knobs (ControlConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.types import Role


@dataclass(frozen=True, slots=True)
class SLA:
    """Latency targets, in milliseconds, at the 90th percentile."""

    ttft_p90_ms: float = 2000.0
    itl_p90_ms: float = 200.0

    def __post_init__(self) -> None:
        for name in ("ttft_p90_ms", "itl_p90_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def met(self, ttft_ms: float, itl_ms: float) -> bool:
        """Whether one request met both targets: its TTFT, and its mean inter-token latency
        (0 for a single-token output)."""
        return ttft_ms <= self.ttft_p90_ms and itl_ms <= self.itl_p90_ms


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """Policy knobs (controller flags of the same names).

    Attributes:
        min_prefill, max_prefill, min_decode, max_decode: replica bounds per role.
        target_utilization: fraction of a worker's fitted capacity to plan for (headroom
            for bursts and for the model's error).
        hysteresis: scale down only if demand fits under target_utilization * (1 - this).
        scale_up_cooldown_s, scale_down_cooldown_s: minimum time since the role's last
            change before the next scale-up / scale-down.
        scale_down_stable_s: how long the load must stay low before a scale-down.
        max_step: most workers added to one role per decision.
        min_requests: requests needed in the window before SLA percentiles are trusted.
        prefill_backlog_s: queued prefill tokens are planned to clear within
            max(TTFT target, this); 0 keeps the TTFT target. A worker added now serves only
            after it has started, so clearing a burst's queue within the TTFT target is
            not something added workers can do; asking for it overshoots.
        decode_backlog_s: 0 sizes decode scale-up by sequences (running + waiting over
            the batch capacity). > 0 sizes it by token rate (see `decode_token_demand`):
            sequences waiting for KV are planned to be served within this many seconds
            instead of all being seated at once.
        max_down_step: most workers removed from one role per decision.
        scale_up_trial_s: an automatic scale-up is judged this long after its workers all
            serve: kept if goodput (requests/s within the SLA) over these seconds beat the
            same span before it, else undone (`tandem.control.trial`); 0: not judged. The
            controller's window_s should hold it.
        worker_start_timeout_s: added workers not all serving this long after a scale-up
            count as not added (still loading, or Pending pods): the scale-up is undone.
        undo_cooldown_s: no scale-up of a role this long after one of its scale-ups was
            undone.
    """

    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    target_utilization: float = 0.7
    hysteresis: float = 0.2
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    scale_down_stable_s: float = 60.0
    max_step: int = 2
    min_requests: int = 20
    prefill_backlog_s: float = 0.0
    decode_backlog_s: float = 0.0
    max_down_step: int = 1
    scale_up_trial_s: float = 30.0
    worker_start_timeout_s: float = 300.0
    undo_cooldown_s: float = 300.0

    def __post_init__(self) -> None:
        for role in Role:
            lo, hi = self.bounds(role)
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"need 0 <= min_{role} <= max_{role} and max >= 1, got {lo}, {hi}")
        if self.min_decode < 1:
            raise ValueError(
                f"min_decode must be >= 1 (decode serves every request), got {self.min_decode}"
            )
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        for name in (
            "scale_up_cooldown_s",
            "scale_down_cooldown_s",
            "scale_down_stable_s",
            "scale_up_trial_s",
            "undo_cooldown_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_step < 1:
            raise ValueError(f"max_step must be >= 1, got {self.max_step}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be >= 1, got {self.min_requests}")
        for name in ("prefill_backlog_s", "decode_backlog_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_down_step < 1:
            raise ValueError(f"max_down_step must be >= 1, got {self.max_down_step}")
        if not self.worker_start_timeout_s > 0:
            raise ValueError(
                f"worker_start_timeout_s must be > 0, got {self.worker_start_timeout_s}"
            )

    def bounds(self, role: str) -> tuple[int, int]:
        if role == Role.PREFILL:
            return self.min_prefill, self.max_prefill
        return self.min_decode, self.max_decode

    @property
    def low_utilization(self) -> float:
        """The stricter target a scale-down must fit under (the hysteresis band)."""
        return self.target_utilization * (1 - self.hysteresis)
