"""proto <-> core conversions. Proto types never travel past this module's callers.

One conversion per hop: the router turns the public request into a `RequestSpec`, and the
worker requests are built from it (`prefill_request_to_proto`, and `decode_request_to_proto`
from a `DecodeInput`); each worker turns its request back into a `RequestSpec` with
`spec_from_proto`, and the decode worker its continuation with `decode_from_proto`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.chat import Message, ToolCall
from tandem.engine.engine import RequestOutput
from tandem.engine.grammar import Constraint, ConstraintKind
from tandem.engine.request import RequestSpec, Resume
from tandem.engine.sampling import LogprobEntry, SamplingParams
from tandem.routing.stall import HopProgress
from tandem.services.common.redis.worker_info import WorkerInfo
from tandem.transfer import KVHandoff, KVLayout, RankKV, RemoteKV
from tandem.transfer.sections import HandoffSection
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.wire import finish_reason_to_proto

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


def chat_from_proto(msg: rpb.ChatMessages) -> tuple[Message, ...]:
    """The messages as the chat rule (tandem.chat.check_messages) reads them; unchecked."""
    return tuple(
        Message(
            role=m.role,
            content=m.content,
            name=m.name,
            tool_call_id=m.tool_call_id,
            tool_calls=tuple(
                ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls
            ),
        )
        for m in msg.messages
    )


def chat_message_to_proto(message: Message) -> rpb.ChatMessage:
    return rpb.ChatMessage(
        role=message.role,
        content=message.content,
        name=message.name,
        tool_call_id=message.tool_call_id,
        tool_calls=[
            rpb.ToolCall(id=c.id, function=rpb.FunctionCall(name=c.name, arguments=c.arguments))
            for c in message.tool_calls
        ],
    )


def sampling_from_proto(msg: rpb.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults. Raises ValueError naming a bad field."""
    kwargs: dict[str, object] = {f: getattr(msg, f) for f in _OPTIONAL_FIELDS if msg.HasField(f)}
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["stop"] = tuple(msg.stop)
    kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("constraint"):
        kwargs["constraint"] = constraint_from_proto(msg.constraint)
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
        logit_bias=dict(params.logit_bias),
    )
    if params.top_k is not None:
        msg.top_k = params.top_k
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.constraint is not None:
        msg.constraint.CopyFrom(constraint_to_proto(params.constraint))
    return msg


def constraint_from_proto(msg: rpb.Constraint) -> Constraint | None:
    """None when no kind is set. Validates (milliseconds for a large schema, once per
    content per process). Raises ValueError naming the field (`constraint.json_schema: ...`)."""
    kind = msg.WhichOneof("kind")
    try:
        if kind is None:
            return None
        if kind == "json_object":
            if not msg.json_object:
                raise ValueError("json_object must be true (unset the constraint for free text)")
            return Constraint(ConstraintKind.JSON_OBJECT)
        if kind == "choice":
            return Constraint(ConstraintKind.CHOICE, tuple(msg.choice.choices))
        return Constraint(ConstraintKind(kind), getattr(msg, kind))
    except ValueError as exc:
        raise ValueError(f"constraint.{exc}") from None


def constraint_to_proto(constraint: Constraint) -> rpb.Constraint:
    kind = constraint.kind
    if kind == ConstraintKind.JSON_OBJECT:
        return rpb.Constraint(json_object=True)
    if kind == ConstraintKind.CHOICE:
        return rpb.Constraint(choice=rpb.Choices(choices=list(constraint.spec)))
    return rpb.Constraint(**{kind.value: constraint.spec})  # type: ignore[arg-type]


def stop_reason_to_proto(stop_reason: int | str | None) -> str:
    return "" if stop_reason is None else str(stop_reason)


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


def kv_layout_to_proto(layout: KVLayout) -> wpb.KvLayout:
    return wpb.KvLayout(
        memory_type=layout.memory_type,
        device_id=layout.device_id,
        dtype=layout.dtype,
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        order=layout.order,
        k_scales=layout.k_scales,
        v_scales=layout.v_scales,
    )


def kv_layout_from_proto(msg: wpb.KvLayout) -> KVLayout:
    """Raises ValueError naming a bad field."""
    return KVLayout(
        memory_type=msg.memory_type,
        device_id=msg.device_id,
        dtype=msg.dtype,
        num_layers=msg.num_layers,
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        order=msg.order,
        k_scales=tuple(msg.k_scales),
        v_scales=tuple(msg.v_scales),
    )


def remote_kv_to_proto(remote: RemoteKV, **fields: object) -> wpb.KvHandle:
    """KvHandle for `remote`; `fields` sets the rest (num_tokens, block_size, lease, ...)."""
    return wpb.KvHandle(
        transport=remote.transport,
        agent_name=remote.agent_name,
        agent_metadata=remote.agent_metadata,
        base_addr=remote.base_addr,
        block_bytes=remote.block_bytes,
        block_ids=list(remote.block_ids),
        layout=kv_layout_to_proto(remote.layout),
        ranks=[
            wpb.KvRank(base_addr=r.base_addr, head_start=r.head_start, num_heads=r.num_heads)
            for r in remote.ranks
        ],
        **fields,  # type: ignore[arg-type]
    )


def remote_kv_from_proto(msg: wpb.KvHandle) -> RemoteKV:
    """Raises ValueError naming a bad field; a handle without a layout (from a prefill worker
    that predates it) is refused: nothing would say what its bytes are."""
    if not msg.HasField("layout"):
        raise ValueError("layout: the KV handle does not say what its blocks hold")
    try:
        layout = kv_layout_from_proto(msg.layout)
    except ValueError as exc:
        raise ValueError(f"layout.{exc}") from None
    return RemoteKV(
        transport=msg.transport,
        agent_name=msg.agent_name,
        agent_metadata=msg.agent_metadata,
        base_addr=msg.base_addr,
        block_bytes=msg.block_bytes,
        block_ids=tuple(msg.block_ids),
        layout=layout,
        ranks=tuple(RankKV(r.base_addr, r.head_start, r.num_heads) for r in msg.ranks),
    )


def prefill_response_to_proto(request_id: str, out: RequestOutput) -> wpb.PrefillResponse:
    """A prefill worker's answer: token 1 and how the request ended there (the KV hand-off,
    when there is one, is added by the caller)."""
    msg = wpb.PrefillResponse(
        request_id=request_id,
        first_token_id=out.new_token_ids[0] if out.new_token_ids else 0,
        text=out.new_text,
        finished=out.finished,
        finish_reason=finish_reason_to_proto(out.finish_reason),
        num_cached_tokens=out.num_cached_tokens,
        stop_reason=stop_reason_to_proto(out.stop_reason),
    )
    if out.logprobs:
        msg.logprobs.extend(logprobs_to_proto(out.new_token_ids, out.logprobs))
    return msg


def chunk_to_proto(outs: Sequence[RequestOutput]) -> rpb.Chunk:
    """One streamed chunk carrying the new tokens of consecutive outputs of a request."""
    chunk = rpb.Chunk()
    for out in outs:
        chunk.token_ids.extend(out.new_token_ids)
        chunk.text += out.new_text
        if out.logprobs:
            chunk.logprobs.extend(logprobs_to_proto(out.new_token_ids, out.logprobs))
    return chunk


def progress_to_proto(p: HopProgress) -> wpb.Progress:
    return wpb.Progress(
        queue_position=p.queue_position,
        computed_tokens=p.computed_tokens,
        engine_steps=p.engine_steps,
    )


def progress_from_proto(msg: wpb.Progress) -> HopProgress:
    return HopProgress(msg.queue_position, msg.computed_tokens, msg.engine_steps)


def worker_stats_to_proto(info: WorkerInfo) -> wpb.WorkerStats:
    """A worker's record and its load on the wire (the worker's own counters, aborts and
    reaps, are the caller's to add)."""
    return wpb.WorkerStats(
        worker_id=info.worker_id,
        role=info.role,
        num_running=info.num_running,
        num_waiting=info.num_waiting,
        queued_prefill_tokens=info.queued_prefill_tokens,
        num_blocks=info.num_blocks,
        num_free_blocks=info.num_free_blocks,
        num_pinned_requests=info.num_handed_off,
        num_preemptions=info.num_preemptions,
        epoch=info.epoch,
    )


def handoff_to_proto(handoff: KVHandoff) -> wpb.KvHandle:
    return remote_kv_to_proto(
        handoff.remote,
        num_tokens=handoff.num_tokens,
        block_size=handoff.block_size,
        prefill_address=handoff.owner_address,
        lease=wpb.Lease(
            lease_id=handoff.lease_id,
            epoch=handoff.epoch,
            expires_at_unix_s=handoff.expires_at,
        ),
        signature=handoff.signature,
        sections=[
            wpb.KvSection(kind=s.kind, format=s.format, num_blocks=s.num_blocks,
                          num_bytes=s.num_bytes)
            for s in handoff.sections
        ],
    )  # fmt: skip


def handoff_from_proto(msg: wpb.KvHandle) -> KVHandoff:
    """Raises ValueError naming a bad field (see `remote_kv_from_proto`)."""
    return KVHandoff(
        remote=remote_kv_from_proto(msg),
        block_size=msg.block_size,
        num_tokens=msg.num_tokens,
        owner_address=msg.prefill_address,
        lease_id=msg.lease.lease_id,
        epoch=msg.lease.epoch,
        expires_at=msg.lease.expires_at_unix_s,
        signature=msg.signature,
        sections=tuple(
            HandoffSection(s.kind, s.format, s.num_blocks, s.num_bytes) for s in msg.sections
        ),
    )


def spec_from_proto(
    msg: wpb.PrefillRequest | wpb.DecodeRequest, request_id: str, timeout_s: float | None
) -> RequestSpec:
    """A worker's request as the core sees it. Raises ValueError naming a bad field."""
    return RequestSpec(
        request_id=request_id,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        params=sampling_from_proto(msg.sampling),
        timeout_s=timeout_s,
        cache_salt=msg.cache_salt,
    )


def prefill_request_to_proto(spec: RequestSpec, decode_worker: str) -> wpb.PrefillRequest:
    return wpb.PrefillRequest(
        request_id=spec.request_id,
        prompt_token_ids=spec.prompt_token_ids,
        sampling=sampling_to_proto(spec.params),
        decode_worker=decode_worker,
        cache_salt=spec.cache_salt,
    )


class BadHandoff(ValueError):
    """A decode request's KV handle does not parse (a deployment problem: the prefill worker
    built it, not the client)."""


@dataclass(frozen=True, slots=True)
class DecodeInput:
    """A decode worker's request as the core sees it.

    Attributes:
        output_token_ids: tokens the client has already been sent (token 1 after a prefill
            hop; every streamed token after a migration); the decode worker continues them.
        num_emitted_chars: characters of text the client has already been sent.
        handoff: the prefill worker's KV hand-off; None: the decode worker prefills.
        report_kv_failure: an unusable hand-off ends the stream with `kv_failed` (the router
            prefills again elsewhere) instead of being recomputed there.
    """

    spec: RequestSpec
    output_token_ids: tuple[int, ...] = ()
    num_emitted_chars: int = 0
    handoff: KVHandoff | None = None
    report_kv_failure: bool = False

    @property
    def resume(self) -> Resume:
        """Where the engine continues. After a hand-off the count is exact (token 1's text
        may be partly held back); without one (a migrated stream), 0 is the wire's unset
        value and means every token's text was sent."""
        emitted = self.num_emitted_chars
        exact = self.handoff is not None or emitted > 0
        return Resume(self.output_token_ids, emitted if exact else None)


def decode_request_to_proto(decode: DecodeInput) -> wpb.DecodeRequest:
    """The router's decode call: `decode_from_proto` on the worker gives it back."""
    spec = decode.spec
    msg = wpb.DecodeRequest(
        request_id=spec.request_id,
        prompt_token_ids=spec.prompt_token_ids,
        output_token_ids=decode.output_token_ids,
        num_emitted_chars=decode.num_emitted_chars,
        sampling=sampling_to_proto(spec.params),
        cache_salt=spec.cache_salt,
    )
    if decode.handoff is not None:
        msg.kv.CopyFrom(handoff_to_proto(decode.handoff))
        msg.report_kv_failure = decode.report_kv_failure
    return msg


def decode_from_proto(msg: wpb.DecodeRequest, spec: RequestSpec) -> DecodeInput:
    """The decode worker's view of its request; `spec`: `spec_from_proto(msg, ...)`.

    Raises:
        ValueError: a hand-off without token 1 (output_token_ids empty).
        BadHandoff: naming the KV handle's bad field.
    """
    outputs = tuple(msg.output_token_ids)
    handoff = None
    if msg.HasField("kv"):
        if not outputs:
            raise ValueError("output_token_ids must hold token 1")
        try:
            handoff = handoff_from_proto(msg.kv)
        except ValueError as exc:
            raise BadHandoff(str(exc)) from None
    return DecodeInput(spec, outputs, msg.num_emitted_chars, handoff, msg.report_kv_failure)
