from tandem.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Lease(_message.Message):
    __slots__ = ("lease_id", "epoch", "expires_at_unix_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    expires_at_unix_s: float
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., expires_at_unix_s: _Optional[float] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("memory_type", "device_id", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "order", "k_scales", "v_scales")
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    memory_type: str
    device_id: int
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    order: str
    k_scales: _containers.RepeatedScalarFieldContainer[float]
    v_scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, memory_type: _Optional[str] = ..., device_id: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., order: _Optional[str] = ..., k_scales: _Optional[_Iterable[float]] = ..., v_scales: _Optional[_Iterable[float]] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("transport", "agent_name", "agent_metadata", "base_addr", "block_bytes", "block_ids", "num_tokens", "block_size", "lease", "prefill_address", "layout", "signature", "ranks", "sections")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SECTIONS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    block_size: int
    lease: Lease
    prefill_address: str
    layout: KvLayout
    signature: bytes
    ranks: _containers.RepeatedCompositeFieldContainer[KvRank]
    sections: _containers.RepeatedCompositeFieldContainer[KvSection]
    def __init__(self, transport: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., block_bytes: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., prefill_address: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., signature: _Optional[bytes] = ..., ranks: _Optional[_Iterable[_Union[KvRank, _Mapping]]] = ..., sections: _Optional[_Iterable[_Union[KvSection, _Mapping]]] = ...) -> None: ...

class KvSection(_message.Message):
    __slots__ = ("kind", "format", "num_blocks", "num_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    format: str
    num_blocks: int
    num_bytes: int
    def __init__(self, kind: _Optional[str] = ..., format: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class KvRank(_message.Message):
    __slots__ = ("base_addr", "head_start", "num_heads")
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    base_addr: int
    head_start: int
    num_heads: int
    def __init__(self, base_addr: _Optional[int] = ..., head_start: _Optional[int] = ..., num_heads: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_worker", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _router_pb2.SamplingParams
    decode_worker: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_router_pb2.SamplingParams, _Mapping]] = ..., decode_worker: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "text", "logprobs", "finished", "finish_reason", "stop_reason", "num_cached_tokens", "kv")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_router_pb2.TokenLogprob]
    finished: bool
    finish_reason: _router_pb2.FinishReason
    stop_reason: str
    num_cached_tokens: int
    kv: KvHandle
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_router_pb2.TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_router_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., kv: _Optional[_Union[KvHandle, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("queue_position", "computed_tokens", "engine_steps")
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    queue_position: int
    computed_tokens: int
    engine_steps: int
    def __init__(self, queue_position: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., engine_steps: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    result: PrefillResponse
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., result: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    epoch: int
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("valid",)
    VALID_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    def __init__(self, valid: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "num_emitted_chars", "sampling", "kv", "report_kv_failure", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_CHARS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    REPORT_KV_FAILURE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_emitted_chars: int
    sampling: _router_pb2.SamplingParams
    kv: KvHandle
    report_kv_failure: bool
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_emitted_chars: _Optional[int] = ..., sampling: _Optional[_Union[_router_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KvHandle, _Mapping]] = ..., report_kv_failure: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class KvFailed(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DecodeComplete(_message.Message):
    __slots__ = ("finish_reason", "stop_reason", "num_cached_tokens", "recomputed", "kv_transfer_ms", "kv_transfer_bytes")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _router_pb2.FinishReason
    stop_reason: str
    num_cached_tokens: int
    recomputed: bool
    kv_transfer_ms: float
    kv_transfer_bytes: int
    def __init__(self, finish_reason: _Optional[_Union[_router_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., recomputed: _Optional[bool] = ..., kv_transfer_ms: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete", "kv_failed", "progress", "moved")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    KV_FAILED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: _router_pb2.Chunk
    complete: DecodeComplete
    kv_failed: KvFailed
    progress: Progress
    moved: KvMoved
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[_router_pb2.Chunk, _Mapping]] = ..., complete: _Optional[_Union[DecodeComplete, _Mapping]] = ..., kv_failed: _Optional[_Union[KvFailed, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., moved: _Optional[_Union[KvMoved, _Mapping]] = ...) -> None: ...

class KvMoved(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KvHandle
    def __init__(self, kv: _Optional[_Union[KvHandle, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_running", "num_waiting", "queued_prefill_tokens", "num_blocks", "num_free_blocks", "num_pinned_requests", "epoch", "num_aborts", "num_reaped_blocks", "num_audit_violations", "num_preemptions")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTS_FIELD_NUMBER: _ClassVar[int]
    NUM_REAPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_AUDIT_VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    num_blocks: int
    num_free_blocks: int
    num_pinned_requests: int
    epoch: int
    num_aborts: int
    num_reaped_blocks: int
    num_audit_violations: int
    num_preemptions: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_pinned_requests: _Optional[int] = ..., epoch: _Optional[int] = ..., num_aborts: _Optional[int] = ..., num_reaped_blocks: _Optional[int] = ..., num_audit_violations: _Optional[int] = ..., num_preemptions: _Optional[int] = ...) -> None: ...
