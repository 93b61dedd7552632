"""proto <-> core conversions. Proto types never travel past this module's callers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import grpc

from tandem.engine.sampling import SamplingParams
from tandem.transfer import RemoteKV
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb

_FINISH_TO_PROTO = {
    "stop": rpb.FINISH_REASON_STOP,
    "length": rpb.FINISH_REASON_LENGTH,
    "abort": rpb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}

_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "ignore_eos",
    "logprobs",
)


def sampling_from_proto(msg: rpb.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults. Raises ValueError naming a bad field."""
    kwargs: dict[str, object] = {f: getattr(msg, f) for f in _OPTIONAL_FIELDS if msg.HasField(f)}
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["stop"] = tuple(msg.stop)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def sampling_to_proto(params: SamplingParams) -> rpb.SamplingParams:
    msg = rpb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
    )
    if params.top_k is not None:
        msg.top_k = params.top_k
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def finish_reason_to_proto(reason: str | None) -> rpb.FinishReason:
    return _FINISH_TO_PROTO.get(reason or "", rpb.FINISH_REASON_UNSPECIFIED)


def finish_reason_from_proto(value: int) -> str | None:
    return _FINISH_FROM_PROTO.get(value)  # type: ignore[call-overload]


def stop_reason_to_proto(stop_reason: int | str | None) -> str:
    return "" if stop_reason is None else str(stop_reason)


LogprobEntry = tuple[float | None, tuple[tuple[int, float], ...] | None]


def logprobs_to_proto(
    token_ids: Sequence[int], entries: Sequence[LogprobEntry]
) -> list[rpb.TokenLogprob]:
    out = []
    for token_id, (logprob, top) in zip(token_ids, entries, strict=True):
        out.append(
            rpb.TokenLogprob(
                token_id=token_id,
                logprob=logprob if logprob is not None else 0.0,
                top=[rpb.TopLogprob(token_id=t, logprob=lp) for t, lp in (top or ())],
            )
        )
    return out


def logprobs_from_proto(msgs: Sequence[rpb.TokenLogprob]) -> list[LogprobEntry]:
    return [(m.logprob, tuple((t.token_id, t.logprob) for t in m.top)) for m in msgs]


def remote_kv_to_proto(remote: RemoteKV, **fields: object) -> wpb.KvHandle:
    """KvHandle for `remote`; `fields` sets the rest (num_tokens, block_size, lease, ...)."""
    return wpb.KvHandle(
        transport=remote.transport,
        agent_name=remote.agent_name,
        agent_metadata=remote.agent_metadata,
        base_addr=remote.base_addr,
        block_bytes=remote.block_bytes,
        block_ids=list(remote.block_ids),
        **fields,  # type: ignore[arg-type]
    )


def remote_kv_from_proto(msg: wpb.KvHandle) -> RemoteKV:
    return RemoteKV(
        transport=msg.transport,
        agent_name=msg.agent_name,
        agent_metadata=msg.agent_metadata,
        base_addr=msg.base_addr,
        block_bytes=msg.block_bytes,
        block_ids=tuple(msg.block_ids),
    )


async def abort_rpc(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    """End the RPC with a status (context.abort raises; this tells the type checker so)."""
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")
