"""The router: public Router gRPC service. Tokenize, place, orchestrate, stream.

Generate -> RequestSpec (validated once) -> Placer.place -> P.Prefill -> stream token 1
         -> D.Decode(kv hand-off) -> stream the rest -> complete
short prompt -> D.Decode without a hand-off (the decode worker prefills)
client cancel / deadline / Abort -> Abort on both workers
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health

from services.common import convert, errors
from services.common.errors import ServiceError, invalid_argument, rpc
from services.common.process import start_grpc_server
from services.common.redis.request_log import RequestLog
from services.router.config import RouterConfig
from services.router.placer import Placer
from tandem.control import RequestSample
from tandem.engine.request import RequestSpec, check_prompt
from tandem.model.config import ModelConfig
from tandem.model.tokenizer import Tokenizer
from tandem.routing import Dispatch, Placement
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)
SERVICE_NAME = "tandem.v1.Router"

__all__ = ["RouterConfig", "RouterServer"]


@dataclass(slots=True)
class _Call:
    """A Generate call in flight: where it runs, how far it got, what the client is told."""

    spec: RequestSpec
    placement: Placement
    dispatch: Dispatch
    t_start: float
    usage: rpb.Usage
    timings: rpb.Timings
    worker_call: grpc.aio.Call | None = None
    aborted: bool = False  # by Router.Abort
    finished: bool = False  # the client got its `complete`

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t_start) * 1e3


class RouterServer(rgrpc.RouterServicer):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.model_id = config.model_id or config.model_dir.rstrip("/").split("/")[-1]
        self.max_model_len = self.model_config.max_position_embeddings
        self.placer = Placer(config, self.model_id)
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.address = ""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._calls: dict[str, _Call] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._request_log: RequestLog | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        log.info("router routing: %r", self.config.routing)
        await self.placer.start()
        if self.config.redis_url:
            self._request_log = RequestLog(self.config.redis_url, self.model_id)
            await self._request_log.start()
        self.server, port = await start_grpc_server(
            self.config.host,
            self.config.port,
            (SERVICE_NAME,),
            lambda server: rgrpc.add_RouterServicer_to_server(self, server),
            self.health,
        )
        self.address = f"{self.config.host}:{port}"
        log.info("router serving %s on %s", self.model_id, self.address)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=2.0)
        await self.placer.stop()
        if self._request_log is not None:
            await self._request_log.stop()
        for ch in self._channels.values():
            await ch.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return ch

    # -- the public request -> RequestSpec ------------------------------------------------

    def _prompt(self, request: rpb.GenerateRequest | rpb.TokenizeRequest) -> tuple[list[int], str]:
        """Token ids (and the prompt text, if any) of a request. Raises ServiceError."""
        if request.model and request.model != self.model_id:
            raise invalid_argument(
                f"model: unknown model {request.model!r}; this router serves {self.model_id!r}"
            )
        kind = request.WhichOneof("input")
        try:
            if kind == "text":
                text = request.text
                return (self.tokenizer.encode(text) if text else []), text
            if kind == "chat":
                chat = request.chat
                messages = [{"role": m.role, "content": m.content} for m in chat.messages]
                add_gen = (
                    chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
                )
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen)
                return self.tokenizer.encode(text, add_special_tokens=False), text
            if kind == "token_ids" and isinstance(request, rpb.GenerateRequest):
                return list(request.token_ids.ids), ""
        except ValueError as exc:
            raise invalid_argument(f"{kind}: {exc}") from None
        raise invalid_argument("input: set text, chat or token_ids")

    def _spec(
        self, request: rpb.GenerateRequest, request_id: str, timeout_s: float | None
    ) -> RequestSpec:
        """The request as every later hop sees it, validated once. Raises ServiceError."""
        tokens, _ = self._prompt(request)
        vocab = self.model_config.vocab_size
        try:
            check_prompt(tokens, vocab, self.max_model_len)
        except ValueError as exc:
            raise invalid_argument(f"{request.WhichOneof('input') or 'input'}: {exc}") from None
        try:
            params = convert.sampling_from_proto(request.sampling)
            params.validate_for_vocab(vocab)
        except ValueError as exc:
            raise invalid_argument(f"sampling.{exc}") from None
        return RequestSpec(request_id, tuple(tokens), params, self.model_id, timeout_s)

    def _check_admission(self, request_id: str) -> None:
        if request_id in self._calls:
            raise invalid_argument(f"request_id: {request_id!r} is already running")
        if len(self._calls) >= self.config.max_inflight:
            raise errors.resource_exhausted(
                f"router has {len(self._calls)} requests in flight (max_inflight); retry later"
            )

    # -- RPCs ------------------------------------------------------------------------------

    @rpc
    async def Generate(
        self, request: rpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.GenerateResponse]:
        t_start = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        self._check_admission(rid)
        spec = self._spec(request, rid, context.time_remaining())
        placement = await self.placer.place(spec)
        call = self._calls[spec.request_id] = self._open(spec, placement, t_start)
        try:
            async for response in self._run(call, context):
                yield response
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            # Abort() cancels the worker call; depending on where it lands that surfaces
            # as CancelledError or as a CANCELLED status. A client's own cancel re-raises.
            if call.aborted:
                call.finished = True
                yield self._complete(call, rpb.FINISH_REASON_ABORT, "")
                return
            if isinstance(exc, asyncio.CancelledError):
                raise
            error = errors.from_worker(exc)
            yield rpb.GenerateResponse(request_id=spec.request_id, error=_error(error))
            raise error from None
        except ServiceError as error:
            yield rpb.GenerateResponse(request_id=spec.request_id, error=_error(error))
            raise
        finally:
            self._close(call)

    def _open(self, spec: RequestSpec, placement: Placement, t_start: float) -> _Call:
        timings = rpb.Timings(
            queue_ms=(time.perf_counter() - t_start) * 1e3,
            disaggregated=placement.disaggregated,
            prefill_worker=placement.prefill.worker_id if placement.prefill else "",
            decode_worker=placement.decode.worker_id,
            route_reason=placement.reason,
            route_cached_tokens=placement.cached_tokens,
            index_degraded=self.placer.index_degraded,
        )
        dispatch = self.placer.inflight.dispatch(placement, spec.num_prompt_tokens)
        usage = rpb.Usage(prompt_tokens=spec.num_prompt_tokens)
        return _Call(spec, placement, dispatch, t_start, usage, timings)

    def _close(self, call: _Call) -> None:
        self._calls.pop(call.spec.request_id, None)
        call.dispatch.finish()
        if not call.finished or call.aborted:
            # Client cancelled, deadline passed, Abort, or a worker failed: stop both sides.
            self._spawn(self._abort_workers(call.spec.request_id, call.placement))

    async def _run(
        self, call: _Call, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.GenerateResponse]:
        """Prefill (when placed on a prefill worker), then decode; the client's messages."""
        rid, prefilled = call.spec.request_id, None
        if call.placement.prefill is not None:
            stub = wgrpc.PrefillWorkerStub(self._channel(call.placement.prefill.address))
            prefill_request = convert.prefill_request_to_proto(
                call.spec, call.placement.decode.worker_id
            )
            call.worker_call = stub.Prefill(prefill_request, timeout=context.time_remaining())
            prefilled = await call.worker_call
            call.dispatch.prefill_done()
            call.timings.first_token_ms = call.elapsed_ms()
            call.usage.completion_tokens = 1
            call.usage.cached_prompt_tokens = prefilled.num_cached_tokens
            chunk = rpb.Chunk(
                token_ids=[prefilled.first_token_id],
                text=prefilled.text,
                logprobs=prefilled.logprobs,
            )
            yield rpb.GenerateResponse(request_id=rid, chunk=chunk)
            if prefilled.finished:
                yield self._complete(call, prefilled.finish_reason, prefilled.stop_reason)
                return
        stub_d = wgrpc.DecodeWorkerStub(self._channel(call.placement.decode.address))
        decode_request = convert.decode_request_to_proto(call.spec, prefilled)
        call.worker_call = stream = stub_d.Decode(decode_request, timeout=context.time_remaining())
        async for msg in stream:
            if msg.WhichOneof("kind") == "chunk":
                if call.usage.completion_tokens == 0 and msg.chunk.token_ids:
                    call.timings.first_token_ms = call.elapsed_ms()
                call.usage.completion_tokens += len(msg.chunk.token_ids)
                yield rpb.GenerateResponse(request_id=rid, chunk=msg.chunk)
            elif msg.WhichOneof("kind") == "complete":
                done = msg.complete
                if not call.placement.disaggregated:
                    call.usage.cached_prompt_tokens = done.num_cached_tokens
                call.timings.kv_transfer_ms = done.kv_transfer_ms
                yield self._complete(call, done.finish_reason, done.stop_reason)
        if not call.finished:
            raise ServiceError(grpc.StatusCode.INTERNAL, "decode worker ended without a result")

    def _complete(
        self, call: _Call, finish_reason: rpb.FinishReason, stop_reason: str
    ) -> rpb.GenerateResponse:
        """The final message of a request; a finished one's timings go to the controller."""
        call.finished = True
        if finish_reason != rpb.FINISH_REASON_ABORT:
            call.timings.total_ms = call.elapsed_ms()
            self._record(call)
        complete = rpb.Complete(
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            usage=call.usage,
            timings=call.timings,
        )
        return rpb.GenerateResponse(request_id=call.spec.request_id, complete=complete)

    def _record(self, call: _Call) -> None:
        if self._request_log is None:
            return
        usage, timings = call.usage, call.timings
        self._request_log.record(
            RequestSample.of(
                t=time.time(),
                ttft_ms=timings.first_token_ms,
                total_ms=timings.total_ms,
                prompt_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_prompt_tokens,
                disaggregated=timings.disaggregated,
            )
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_workers(self, rid: str, placement: Placement) -> None:
        req = rpb.AbortRequest(request_id=rid)
        targets = [(wgrpc.DecodeWorkerStub, placement.decode.address)]
        if placement.prefill is not None:
            targets.append((wgrpc.PrefillWorkerStub, placement.prefill.address))  # type: ignore[arg-type]
        for stub_cls, address in targets:
            try:
                await stub_cls(self._channel(address)).Abort(req, timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                log.warning("abort of %s on %s failed: %s", rid, address, exc.code())

    @rpc
    async def Tokenize(
        self, request: rpb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> rpb.TokenizeResponse:
        tokens, text = self._prompt(request)
        return rpb.TokenizeResponse(token_ids=tokens, prompt=text)

    @rpc
    async def ListModels(
        self, request: rpb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ListModelsResponse:
        model = rpb.ModelInfo(
            id=self.model_id,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            block_size=self.config.block_size,
        )
        return rpb.ListModelsResponse(models=[model])

    @rpc
    async def Abort(
        self, request: rpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rpb.AbortResponse:
        call = self._calls.get(request.request_id)
        if call is None:
            return rpb.AbortResponse(found=False)
        call.aborted = True
        if call.worker_call is not None:
            call.worker_call.cancel()
        return rpb.AbortResponse(found=True)


def _error(error: ServiceError) -> rpb.Error:
    return rpb.Error(code=error.code.value[0], message=error.message)
