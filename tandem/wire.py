"""The closed sets of tandem.types as the public protos spell them: one table, read by the
services' converters (tandem.services.common.rpc.convert) and by the Python client
(tandem.client)."""

from __future__ import annotations

from tandem.types import FinishReason
from tandem.v1 import router_pb2 as rpb

_FINISH_TO_PROTO = {
    FinishReason.STOP: rpb.FINISH_REASON_STOP,
    FinishReason.LENGTH: rpb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: rpb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | str | None) -> rpb.FinishReason:
    """`reason`: a FinishReason or its value (the engine's `RequestOutput.finish_reason`)."""
    return _FINISH_TO_PROTO.get(reason or "", rpb.FINISH_REASON_UNSPECIFIED)  # type: ignore[call-overload]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (not finished) or a value this build does not know."""
    return _FINISH_FROM_PROTO.get(value)  # type: ignore[call-overload]
