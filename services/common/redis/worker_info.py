"""What a worker advertises in the registry: the `WorkerInfo` record, its validation, its JSON
form, and the Redis key it lives under (`tandem:worker:<worker_id>`). No I/O: `registry.py`
writes and reads these records."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tandem.load import Load, check_load, load_fields
from tandem.routing import WorkerLoad
from tandem.types import Role

KEY_PREFIX = "tandem:worker:"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo(Load):
    """What one worker advertises: identity, address, and its `Load` at `updated_at` (the
    ratio controller fits its throughput model from the rates, the router places and admits
    by the counts and the prefill rate).

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
    # A decode worker that continues streams a draining decode worker moves with their KV
    # (issue 46: the KV of prompt and output); False from one that predates it, which a
    # draining worker never moves streams to.
    accepts_moved: bool = False
    # Speculative decoding's method ("", "ngram", "suffix", "draft"; tandem.config.
    # SpeculativeConfig; "" when off or from a worker that predates it): shown, not placed on.
    speculative: str = ""
    # The draft model's KV hand-off section format (LLMEngine.draft_format); "" without a draft
    # model or from a worker that predates it. The router pairs equal formats only.
    draft_format: str = ""

    def __post_init__(self) -> None:
        for name in ("worker_id", "role", "address", "model"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"WorkerInfo.{name} must be a non-empty str, got {value!r}")
        if self.role not in tuple(Role):
            names = tuple(map(str, Role))
            raise ValueError(f"WorkerInfo.role must be one of {names}, got {self.role!r}")
        object.__setattr__(self, "role", Role(self.role))
        # bool is an int subclass; `True` as an epoch is a bug.
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool):
            raise ValueError(f"WorkerInfo.epoch must be an int, got {self.epoch!r}")
        check_load(self, "WorkerInfo")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"WorkerInfo.tensor_parallel_size must be an int >= 1, got {tp!r}")
        for name in ("kv_format", "speculative", "draft_format"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"WorkerInfo.{name} must be a str, got {value!r}")
        if not isinstance(self.accepts_moved, bool):
            raise ValueError(f"WorkerInfo.accepts_moved must be a bool, got {self.accepts_moved!r}")
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
            **load_fields(self),
            worker_id=self.worker_id,
            role=Role(self.role),
            address=self.address,
            draining=self.draining,
            kv_format=self.kv_format,
            tensor_parallel_size=self.tensor_parallel_size,
            kv_handoff=self.kv_handoff,
            accepts_moved=self.accepts_moved,
            speculative=self.speculative,
            draft_format=self.draft_format,
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
