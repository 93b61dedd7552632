"""The engine: paged KV cache, prefix caching, continuous batching, sampling."""

from tandem.engine.block_pool import BlockPool, KVEvent, KVEventKind
from tandem.engine.engine import Completion, LLMEngine, RequestOutput
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.prefix_hash import hash_block, hash_blocks
from tandem.engine.request import Request, RequestSpec, RequestStatus, Resume, check_prompt
from tandem.engine.sampling import SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerOutput

__all__ = [
    "BlockPool",
    "Completion",
    "KVCacheManager",
    "KVEvent",
    "KVEventKind",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "RequestSpec",
    "RequestStatus",
    "Resume",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "check_prompt",
    "hash_block",
    "hash_blocks",
]
