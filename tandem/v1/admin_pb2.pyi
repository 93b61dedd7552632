from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoleStatus(_message.Message):
    __slots__ = ("role", "current", "desired", "live", "draining", "min", "max", "reason", "ready")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    role: str
    current: int
    desired: int
    live: int
    draining: int
    min: int
    max: int
    reason: str
    ready: int
    def __init__(self, role: _Optional[str] = ..., current: _Optional[int] = ..., desired: _Optional[int] = ..., live: _Optional[int] = ..., draining: _Optional[int] = ..., min: _Optional[int] = ..., max: _Optional[int] = ..., reason: _Optional[str] = ..., ready: _Optional[int] = ...) -> None: ...

class HostCapacity(_message.Message):
    __slots__ = ("max_workers", "num_workers", "reason")
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    max_workers: int
    num_workers: int
    reason: str
    def __init__(self, max_workers: _Optional[int] = ..., num_workers: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Sla(_message.Message):
    __slots__ = ("ttft_p90_ms", "itl_p90_ms")
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_p90_ms: float
    itl_p90_ms: float
    def __init__(self, ttft_p90_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("mode", "roles", "sla", "window_requests", "sla_attainment", "ttft_p90_ms", "itl_p90_ms", "actuator", "last_error", "last_decision_unix", "workers", "recent", "observed_unix", "capacity")
    MODE_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    SLA_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SLA_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ACTUATOR_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_UNIX_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_UNIX_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    mode: str
    roles: _containers.RepeatedCompositeFieldContainer[RoleStatus]
    sla: Sla
    window_requests: int
    sla_attainment: float
    ttft_p90_ms: float
    itl_p90_ms: float
    actuator: str
    last_error: str
    last_decision_unix: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    recent: LatencySummary
    observed_unix: float
    capacity: HostCapacity
    def __init__(self, mode: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[RoleStatus, _Mapping]]] = ..., sla: _Optional[_Union[Sla, _Mapping]] = ..., window_requests: _Optional[int] = ..., sla_attainment: _Optional[float] = ..., ttft_p90_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ..., actuator: _Optional[str] = ..., last_error: _Optional[str] = ..., last_decision_unix: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., recent: _Optional[_Union[LatencySummary, _Mapping]] = ..., observed_unix: _Optional[float] = ..., capacity: _Optional[_Union[HostCapacity, _Mapping]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "address", "num_running", "num_waiting", "num_blocks", "num_free_blocks", "step_ms", "tokens_per_s", "busy_frac", "draining", "updated_unix", "kv_format", "host_onload_tokens_per_s", "disk_onload_tokens_per_s", "host_tier_blocks", "disk_tier_blocks", "tier_hit_tokens", "speculative", "draft_format")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRAC_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    HOST_ONLOAD_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DISK_ONLOAD_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    step_ms: float
    tokens_per_s: float
    busy_frac: float
    draining: bool
    updated_unix: float
    kv_format: str
    host_onload_tokens_per_s: float
    disk_onload_tokens_per_s: float
    host_tier_blocks: int
    disk_tier_blocks: int
    tier_hit_tokens: int
    speculative: str
    draft_format: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., step_ms: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., busy_frac: _Optional[float] = ..., draining: _Optional[bool] = ..., updated_unix: _Optional[float] = ..., kv_format: _Optional[str] = ..., host_onload_tokens_per_s: _Optional[float] = ..., disk_onload_tokens_per_s: _Optional[float] = ..., host_tier_blocks: _Optional[int] = ..., disk_tier_blocks: _Optional[int] = ..., tier_hit_tokens: _Optional[int] = ..., speculative: _Optional[str] = ..., draft_format: _Optional[str] = ...) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("window_s", "requests", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_MS_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    def __init__(self, window_s: _Optional[float] = ..., requests: _Optional[int] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p90_ms: _Optional[float] = ..., itl_p50_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class DecisionRecord(_message.Message):
    __slots__ = ("unix_time", "current", "target", "reasons", "figures", "applied", "error")
    class CurrentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TargetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class FiguresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    unix_time: float
    current: _containers.ScalarMap[str, int]
    target: _containers.ScalarMap[str, int]
    reasons: _containers.ScalarMap[str, str]
    figures: _containers.ScalarMap[str, float]
    applied: bool
    error: str
    def __init__(self, unix_time: _Optional[float] = ..., current: _Optional[_Mapping[str, int]] = ..., target: _Optional[_Mapping[str, int]] = ..., reasons: _Optional[_Mapping[str, str]] = ..., figures: _Optional[_Mapping[str, float]] = ..., applied: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("decisions",)
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[DecisionRecord]
    def __init__(self, decisions: _Optional[_Iterable[_Union[DecisionRecord, _Mapping]]] = ...) -> None: ...

class SetRatioRequest(_message.Message):
    __slots__ = ("prefill", "decode")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ...) -> None: ...

class SetSlaRequest(_message.Message):
    __slots__ = ("sla",)
    SLA_FIELD_NUMBER: _ClassVar[int]
    sla: Sla
    def __init__(self, sla: _Optional[_Union[Sla, _Mapping]] = ...) -> None: ...

class AutoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
