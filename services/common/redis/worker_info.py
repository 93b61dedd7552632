"""What a worker advertises in the registry: the `WorkerInfo` record, its validation, its JSON
form, and the Redis key it lives under (`tandem:worker:<worker_id>`). No I/O: `registry.py`
writes and reads these records."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tandem.routing import WorkerLoad
from tandem.types import Role

KEY_PREFIX = "tandem:worker:"

_INT_FIELDS = (
    "epoch",
    "num_blocks",
    "num_free_blocks",
    "num_running",
    "num_waiting",
    "queued_prefill_tokens",
)
_COUNT_FIELDS = _INT_FIELDS[1:]  # everything but epoch is a count and cannot be negative
_RATE_FIELDS = ("busy_frac", "tokens_per_s", "step_ms", "prefill_tokens_per_s")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What one worker advertises: identity, address, and load at `updated_at`.

    `busy_frac`, `tokens_per_s` and `step_ms` are the engine's rolling load over the last few
    seconds (fraction of time in steps, tokens computed per second, mean step time); the
    ratio controller fits its throughput model from them. `prefill_tokens_per_s` is the
    prompt tokens per second of step time the worker last measured (kept while idle): the
    router's admission estimate (`tandem.routing.admission`) divides queued tokens by it.

    `epoch` identifies the incarnation (e.g. start time in ns): a worker that restarts under the
    same `worker_id` gets a new epoch, and watchers report it as a departure plus a join since
    whatever lived in the old process (KV blocks, leases) is gone. `updated_at` is wall-clock
    seconds, stamped by `Registry.register`.

    Raises ValueError on a wrong type, an unknown role, an empty id/address/model or a negative
    count.
    """

    worker_id: str
    role: str  # a Role (a plain str is made one)
    address: str
    model: str
    epoch: int
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    busy_frac: float = 0.0
    tokens_per_s: float = 0.0
    step_ms: float = 0.0
    prefill_tokens_per_s: float = 0.0
    draining: bool = False
    updated_at: float = 0.0
    # The KV cache's format (tandem.quant.kv.kv_format: dtype, and an fp8 cache's
    # scales digest); "" from a worker that predates it. The router pairs equal formats only.
    kv_format: str = ""
    # Ranks the worker's model is split over (tensor parallelism, tandem.parallel.sharding);
    # 1 from a worker that predates it.
    tensor_parallel_size: int = 1
    # Whether a tensor-parallel worker's KV can be handed off (its rank 0 maps every rank's
    # cache: on a CPU); False from one that predates it. A single-rank worker's always can
    # (tandem.routing.policy.can_hand_off).
    kv_handoff: bool = False

    def __post_init__(self) -> None:
        for name in ("worker_id", "role", "address", "model"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"WorkerInfo.{name} must be a non-empty str, got {value!r}")
        if self.role not in tuple(Role):
            names = tuple(map(str, Role))
            raise ValueError(f"WorkerInfo.role must be one of {names}, got {self.role!r}")
        object.__setattr__(self, "role", Role(self.role))
        for name in _INT_FIELDS:
            value = getattr(self, name)
            # bool is an int subclass; `True` blocks is a bug, not a count.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"WorkerInfo.{name} must be an int, got {value!r}")
        for name in _COUNT_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"WorkerInfo.{name} must be >= 0, got {getattr(self, name)}")
        for name in _RATE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"WorkerInfo.{name} must be a number >= 0, got {value!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"WorkerInfo.tensor_parallel_size must be an int >= 1, got {tp!r}")
        if not isinstance(self.kv_format, str):
            raise ValueError(f"WorkerInfo.kv_format must be a str, got {self.kv_format!r}")
        if not isinstance(self.kv_handoff, bool):
            raise ValueError(f"WorkerInfo.kv_handoff must be a bool, got {self.kv_handoff!r}")
        if not isinstance(self.draining, bool):
            raise ValueError(f"WorkerInfo.draining must be a bool, got {self.draining!r}")
        if not isinstance(self.updated_at, int | float) or isinstance(self.updated_at, bool):
            raise ValueError(f"WorkerInfo.updated_at must be a number, got {self.updated_at!r}")

    @property
    def key(self) -> str:
        """The Redis key this worker is registered under."""
        return KEY_PREFIX + self.worker_id

    def load(self) -> WorkerLoad:
        """This worker as the placement policy sees it (before a router adds its own
        in-flight requests)."""
        return WorkerLoad(
            worker_id=self.worker_id,
            role=Role(self.role),
            address=self.address,
            queued_prefill_tokens=self.queued_prefill_tokens,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_free_blocks=self.num_free_blocks,
            num_blocks=self.num_blocks,
            draining=self.draining,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            kv_format=self.kv_format,
            tensor_parallel_size=self.tensor_parallel_size,
            kv_handoff=self.kv_handoff,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        """Parse `to_json` output. Unknown keys are ignored so that newer workers can add
        fields without breaking older routers; anything else malformed raises ValueError."""
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"WorkerInfo JSON does not parse: {exc}; raw={raw!r:.200}") from None
        if not isinstance(data, dict):
            raise ValueError(f"WorkerInfo JSON must be an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("updated_at"), int) and not isinstance(kwargs["updated_at"], bool):
            kwargs["updated_at"] = float(kwargs["updated_at"])
        try:
            return cls(**kwargs)
        except TypeError as exc:  # missing required fields
            raise ValueError(f"WorkerInfo JSON is incomplete: {exc}; raw={raw!r:.200}") from None
