"""The client's messages from a call's core state, and what a finished call leaves behind:
metrics, and its sample in the request log (the controller's latency figures)."""

from __future__ import annotations

import time

from tandem import wire
from tandem.control import RequestSample
from tandem.services.common.observe.metrics import RouterMetrics
from tandem.services.common.redis.request_log import RequestLog
from tandem.services.common.rpc.errors import ServiceError
from tandem.services.router.call import Call, Timings
from tandem.types import FinishReason
from tandem.v1 import router_pb2 as rpb


def usage_to_proto(call: Call) -> rpb.Usage:
    return rpb.Usage(
        prompt_tokens=call.spec.num_prompt_tokens,
        completion_tokens=call.num_output_tokens,
        cached_prompt_tokens=call.cached_prompt_tokens,
    )


def timings_to_proto(t: Timings) -> rpb.Timings:
    return rpb.Timings(
        queue_ms=t.queue_ms,
        first_token_ms=t.first_token_ms,
        total_ms=t.total_ms,
        disaggregated=t.disaggregated,
        prefill_worker=t.prefill_worker,
        decode_worker=t.decode_worker,
        kv_transfer_ms=t.kv_transfer_ms,
        route_reason=t.route_reason,
        route_cached_tokens=t.route_cached_tokens,
        index_degraded=t.index_degraded,
        migrations=t.migrations,
        reprefills=t.reprefills,
        recoveries=t.recoveries,
    )


def error_to_proto(error: ServiceError) -> rpb.Error:
    return rpb.Error(
        code=error.code.value[0], message=error.message, retry_after_ms=error.retry_after_ms
    )


class Replies:
    """Builds a call's messages to the client. `complete` also counts the call finished
    and logs a finished one's sample (`request_log`, set once the router has Redis)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.request_log: RequestLog | None = None

    def chunk(self, call: Call, chunk: rpb.Chunk) -> rpb.GenerateResponse:
        return rpb.GenerateResponse(request_id=call.public_id, chunk=chunk)

    def error(self, public_id: str, error: ServiceError) -> rpb.GenerateResponse:
        return rpb.GenerateResponse(request_id=public_id, error=error_to_proto(error))

    def complete(
        self, call: Call, finish_reason: FinishReason | None, stop_reason: str
    ) -> rpb.GenerateResponse:
        """The final message of a request; a finished one's timings go to the controller."""
        call.finished = True
        aborted = finish_reason is FinishReason.ABORT
        self.metrics.completed(call.timings.disaggregated, aborted, call.elapsed_ms() / 1e3)
        if not aborted:
            call.timings.total_ms = call.elapsed_ms()
            self._record(call)
        complete = rpb.Complete(
            finish_reason=wire.finish_reason_to_proto(finish_reason),
            stop_reason=stop_reason,
            usage=usage_to_proto(call),
            timings=timings_to_proto(call.timings),
        )
        return rpb.GenerateResponse(request_id=call.public_id, complete=complete)

    def _record(self, call: Call) -> None:
        if self.request_log is None:
            return
        timings = call.timings
        self.request_log.record(
            RequestSample.of(
                t=time.time(),
                ttft_ms=timings.first_token_ms,
                total_ms=timings.total_ms,
                prompt_tokens=call.spec.num_prompt_tokens,
                output_tokens=call.num_output_tokens,
                cached_tokens=call.cached_prompt_tokens,
                disaggregated=timings.disaggregated,
            )
        )
