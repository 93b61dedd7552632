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
    __slots__ = ("role", "current", "desired", "live", "draining", "min", "max", "reason")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    role: str
    current: int
    desired: int
    live: int
    draining: int
    min: int
    max: int
    reason: str
    def __init__(self, role: _Optional[str] = ..., current: _Optional[int] = ..., desired: _Optional[int] = ..., live: _Optional[int] = ..., draining: _Optional[int] = ..., min: _Optional[int] = ..., max: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Sla(_message.Message):
    __slots__ = ("ttft_p90_ms", "itl_p90_ms")
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_p90_ms: float
    itl_p90_ms: float
    def __init__(self, ttft_p90_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("mode", "roles", "sla", "window_requests", "sla_attainment", "ttft_p90_ms", "itl_p90_ms", "actuator", "last_error", "last_decision_unix")
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
    def __init__(self, mode: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[RoleStatus, _Mapping]]] = ..., sla: _Optional[_Union[Sla, _Mapping]] = ..., window_requests: _Optional[int] = ..., sla_attainment: _Optional[float] = ..., ttft_p90_ms: _Optional[float] = ..., itl_p90_ms: _Optional[float] = ..., actuator: _Optional[str] = ..., last_error: _Optional[str] = ..., last_decision_unix: _Optional[float] = ...) -> None: ...

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
