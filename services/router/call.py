"""One Generate call's state in the router: where it runs, how far it got, what the client
will be told. Core values only; `replies` builds the client's messages from them."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from tandem.engine.request import RequestSpec
from tandem.routing import Dispatch, Placement
from tandem.services.common.observe import tracing
from tandem.transfer import KVHandoff


class CallContext(Protocol):
    """What handling a request needs of its call: a grpc.aio.ServicerContext has both; the
    HTTP API (tandem.services.router.openai.http) passes its own."""

    def time_remaining(self) -> float | None: ...

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...


def worker_request_id(request_id: str) -> str:
    """The id workers know one attempt of a request by: the client's id (for logs) plus a
    nonce, unique per attempt and per router."""
    return f"{request_id}~{secrets.token_hex(4)}"


@dataclass(slots=True)
class Timings:
    """Milliseconds since the router received the request, and where it ran (the client's
    `Timings`)."""

    queue_ms: float
    disaggregated: bool
    prefill_worker: str
    decode_worker: str
    route_reason: str
    route_cached_tokens: int
    index_degraded: bool
    first_token_ms: float = 0.0
    total_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    migrations: int = 0
    reprefills: int = 0
    recoveries: list[str] = field(default_factory=list)  # one line per recovery step


@dataclass(slots=True)
class Call:
    """A Generate call in flight."""

    spec: RequestSpec  # request_id: the server's id (workers and logs know it)
    placement: Placement
    dispatch: Dispatch
    t_start: float
    timings: Timings
    worker_rid: str = ""
    worker_call: grpc.aio.Call | None = None
    aborted: bool = False  # by Router.Abort
    finished: bool = False  # the client got its `complete`
    outputs: list[int] = field(default_factory=list)  # token ids streamed to the client
    emitted_chars: int = 0  # characters of text streamed to the client
    cached_prompt_tokens: int = 0  # prompt tokens served from a prefix cache
    kv: KVHandoff | None = None  # the prefill hop's hand-off, until the decode hop uses it
    recoveries: int = 0
    failed: set[str] = field(default_factory=set)  # workers that failed this request
    # worker id -> its registry epoch when it failed this request: a restarted incarnation
    # (another epoch) is a new worker, eligible again
    failed_epochs: dict[str, int | None] = field(default_factory=dict)
    restarted: set[str] = field(default_factory=set)  # of those, the ones back since
    public_id: str = ""  # what the client calls it: its label, or the server's id
    tenant: str = ""
    t_last_token: float = 0.0  # perf_counter when the last token reached the client (metrics)
    estimate_s: float | None = None  # expected delay to the first token, at admission
    span: tracing.Span = tracing.INVALID_SPAN  # tandem.generate: the parent of worker spans

    @property
    def key(self) -> tuple[str, str]:
        """(tenant, the client's id): how Abort finds it; a tenant sees only its own."""
        return (self.tenant, self.public_id)

    @property
    def num_output_tokens(self) -> int:
        return len(self.outputs)

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t_start) * 1e3
