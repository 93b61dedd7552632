"""The router: public Router gRPC service. Tokenize, place, orchestrate, stream.

Generate -> validate -> choose (prefill, decode) -> P.Prefill -> stream token 1
         -> D.Decode(kv handle) -> stream the rest -> complete
short prompt -> D.Decode without a handle (the decode worker prefills)
client cancel / deadline / Abort -> Abort on both workers
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from services.common import convert
from services.common.process import start_grpc_server
from services.common.redis.index import RedisPrefixIndex
from services.common.redis.registry import Registry, WorkerInfo, WorkerWatcher
from services.common.redis.request_log import RequestLog
from tandem.control import RequestSample
from tandem.engine.prefix_hash import hash_blocks
from tandem.engine.sampling import SamplingParams
from tandem.index import IndexUnavailable
from tandem.model.config import ModelConfig
from tandem.model.tokenizer import Tokenizer
from tandem.routing import Placement, RouteRequest, RoutingConfig, WorkerLoad, choose
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)
SERVICE_NAME = "tandem.v1.Router"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router process. Flags of `python -m services.router` map 1:1 to fields.

    Attributes:
        model_dir: the served model (the router reads its tokenizer and config only).
        model_id: name clients use; default: the directory name.
        redis_url: worker registry. Empty: use the static address lists instead.
        prefill_addresses, decode_addresses: static workers (tests, single-host setups).
        max_inflight: concurrent Generate calls before RESOURCE_EXHAUSTED.
        block_size: KV block size of the workers (prefix hashes are per block).
        policy: placement policy, "kv" (cache-aware), "load" or "round_robin".
        index_timeout_s: how long a prefix-index lookup may take before the request is
            placed on load alone.
        disagg_min_uncached_tokens: prompts with fewer uncached tokens are prefilled on the
            decode worker (conditional disaggregation); 0 = always disaggregate.
        imbalance_threshold_tokens, cache_weight: see tandem.routing.RoutingConfig.
        affinity_blocks: a prompt's prefix key (its home prefill worker when no worker
            caches it, see tandem.routing) is the chained hash of this many leading blocks,
            or of all full blocks of a shorter prompt. Deep enough to tell apart system
            prompts that open with the same boilerplate; 16 blocks = 256 tokens.
    """

    model_dir: str
    model_id: str = ""
    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str = ""
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    max_inflight: int = 256
    block_size: int = 16
    worker_refresh_s: float = 0.5
    policy: str = "kv"
    index_timeout_s: float = 0.05
    disagg_min_uncached_tokens: int = 64
    imbalance_threshold_tokens: int = 2048
    cache_weight: float = 2.0
    affinity_blocks: int = 16

    def __post_init__(self) -> None:
        if self.max_inflight <= 0:
            raise ValueError(f"max_inflight must be positive, got {self.max_inflight}")
        if self.affinity_blocks <= 0:
            raise ValueError(f"affinity_blocks must be positive, got {self.affinity_blocks}")
        if not self.redis_url and not self.decode_addresses:
            raise ValueError("need redis_url or decode_addresses to find workers")
        _ = self.routing  # validates the routing fields

    @property
    def routing(self) -> RoutingConfig:
        return RoutingConfig(
            policy=self.policy,
            disagg_min_uncached_tokens=self.disagg_min_uncached_tokens,
            imbalance_threshold_tokens=self.imbalance_threshold_tokens,
            cache_weight=self.cache_weight,
        )


@dataclass(slots=True)
class _Active:
    """A Generate call in flight (for Abort and the router's own load accounting)."""

    placement: Placement | None = None
    call: grpc.aio.Call | None = None
    aborted: bool = False


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RouterServer(rgrpc.RouterServicer):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.model_id = config.model_id or config.model_dir.rstrip("/").split("/")[-1]
        self.max_model_len = self.model_config.max_position_embeddings
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.address = ""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._active: dict[str, _Active] = {}
        self._inflight_tokens: dict[str, int] = {}  # prefill worker id -> tokens sent, unfinished
        self._inflight_reqs: dict[str, int] = {}  # decode worker id -> requests, unfinished
        self._registry: Registry | None = None
        self._watcher: WorkerWatcher | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.last_decisions: list[tuple[str, Placement]] = []
        self._sequence = 0
        self._index: RedisPrefixIndex | None = None
        self.index_degraded = False
        self._request_log: RequestLog | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.config.redis_url:
            if self.config.policy == "kv":
                self._index = RedisPrefixIndex(self.config.redis_url)
            self._registry = Registry(self.config.redis_url)
            self._watcher = WorkerWatcher(
                self._registry, self.config.worker_refresh_s, on_change=self._on_workers_change
            )
            await self._watcher.start()
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
        if self._watcher is not None:
            await self._watcher.stop()
        if self._registry is not None:
            await self._registry.close()
        if self._index is not None:
            await self._index.close()
        if self._request_log is not None:
            await self._request_log.stop()
        for ch in self._channels.values():
            await ch.close()

    def _on_workers_change(self, joined: list[WorkerInfo], left: list[str]) -> None:
        for w in joined:
            log.info("worker joined: %s (%s) at %s", w.worker_id, w.role, w.address)
        for worker_id in left:
            log.info("worker left: %s", worker_id)
            if self._index is not None:  # its cache is gone; so are its index entries
                self._spawn(self._forget_worker(worker_id))

    async def _forget_worker(self, worker_id: str) -> None:
        assert self._index is not None
        try:
            await self._index.remove_worker(worker_id)
        except IndexUnavailable:
            pass  # a restarted index does not know the worker either

    async def _lookup(self, hashes: list[int]) -> dict[str, int] | None:
        """Leading cached blocks per worker, or None when the index cannot answer in time
        (then placement uses load alone: no request fails because the index is down)."""
        if self._index is None or not hashes:
            return None
        try:
            overlap = await asyncio.wait_for(
                self._index.lookup(self.model_id, hashes), self.config.index_timeout_s
            )
        except (IndexUnavailable, TimeoutError) as exc:
            if not self.index_degraded:
                log.warning("prefix index unavailable (%r): routing on load alone", exc)
                self.index_degraded = True
            return None
        if self.index_degraded:
            log.info("prefix index reachable again: cache-aware routing resumed")
            self.index_degraded = False
        return overlap

    # -- workers -----------------------------------------------------------------------------

    def workers(self) -> list[WorkerLoad]:
        """Every known worker with its load, as the placement policy sees it."""
        if self._watcher is not None:
            infos = list(self._watcher.snapshot().values())
            infos = [w for w in infos if w.model == self.model_id]
        else:
            infos = [
                WorkerInfo(worker_id=a, role=role, address=a, model=self.model_id, epoch=0)
                for role, addrs in (
                    ("prefill", self.config.prefill_addresses),
                    ("decode", self.config.decode_addresses),
                )
                for a in addrs
            ]
        return [
            WorkerLoad(
                worker_id=w.worker_id,
                role=w.role,
                address=w.address,
                queued_prefill_tokens=w.queued_prefill_tokens,
                num_running=w.num_running,
                num_waiting=w.num_waiting,
                num_free_blocks=w.num_free_blocks,
                num_blocks=w.num_blocks,
                draining=w.draining,
                inflight_requests=self._inflight_reqs.get(w.worker_id, 0),
                inflight_prefill_tokens=self._inflight_tokens.get(w.worker_id, 0),
            )
            for w in infos
        ]

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return ch

    # -- request validation ----------------------------------------------------------------

    def _prompt(self, request: rpb.GenerateRequest | rpb.TokenizeRequest) -> tuple[list[int], str]:
        """Token ids (and the prompt text, if any) of a request. Raises _Rejected."""
        if request.model and request.model != self.model_id:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model: unknown model {request.model!r}; this router serves {self.model_id!r}",
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
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{kind}: {exc}") from None
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "input: set text, chat or token_ids")

    def _validate(self, request: rpb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """Token ids and sampling params of a Generate call. Raises _Rejected."""
        tokens, _ = self._prompt(request)
        if not tokens:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "input: prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in tokens if t >= vocab]
        if bad:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"token_ids: ids outside the vocabulary [0, {vocab}): {bad[:5]}",
            )
        if len(tokens) >= self.max_model_len:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"input: prompt has {len(tokens)} tokens; the model's context is "
                f"{self.max_model_len}",
            )
        try:
            params = convert.sampling_from_proto(request.sampling)
            params.validate_for_vocab(vocab)
        except ValueError as exc:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}") from None
        return tokens, params

    async def _admit(self, request: rpb.GenerateRequest, rid: str) -> tuple[list[int], Placement]:
        """Validate and place a request. Raises _Rejected with the status to return."""
        if rid in self._active:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {rid!r} is already running"
            )
        if len(self._active) >= self.config.max_inflight:
            raise _Rejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router has {len(self._active)} requests in flight (max_inflight); retry later",
            )
        tokens, _ = self._validate(request)
        # The same chained hashes the workers publish (tandem.engine.prefix_hash).
        hashes = hash_blocks(tokens, self.config.block_size, (self.model_id,))
        overlap = await self._lookup(hashes)
        self._sequence += 1
        key = hashes[min(len(hashes), self.config.affinity_blocks) - 1] if hashes else None
        route = RouteRequest(len(tokens), self.config.block_size, overlap, self._sequence, key)
        placement = choose(route, self.workers(), self.config.routing)
        if placement is None:
            raise _Rejected(grpc.StatusCode.UNAVAILABLE, "no decode worker available; retry later")
        log.info(
            "route %s: %d tokens, %d blocks, overlap %s -> prefill %s, decode %s (%s)",
            rid,
            len(tokens),
            len(hashes),
            overlap if overlap is not None else "n/a",
            placement.prefill.worker_id if placement.prefill else "-",
            placement.decode.worker_id,
            placement.reason,
        )
        return tokens, placement

    # -- RPCs ------------------------------------------------------------------------------

    async def Generate(
        self, request: rpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.GenerateResponse]:
        t_start = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        try:
            tokens, placement = await self._admit(request, rid)
        except _Rejected as rej:
            await convert.abort_rpc(context, rej.code, rej.message)
        active = self._active[rid] = _Active(placement)
        self._track_decode(placement, +1)
        self._track_prefill(placement, len(tokens))
        prefill_pending = placement.disaggregated
        self.last_decisions = [*self.last_decisions[-99:], (rid, placement)]
        timings = rpb.Timings(
            queue_ms=(time.perf_counter() - t_start) * 1e3,
            disaggregated=placement.disaggregated,
            prefill_worker=placement.prefill.worker_id if placement.prefill else "",
            decode_worker=placement.decode.worker_id,
            route_reason=placement.reason,
            route_cached_tokens=placement.cached_tokens,
            index_degraded=self.index_degraded,
        )
        usage = rpb.Usage(prompt_tokens=len(tokens))
        finished = False
        timeout = context.time_remaining()
        try:
            decode_req = wpb.DecodeRequest(
                request_id=rid, prompt_token_ids=tokens, sampling=request.sampling
            )
            if placement.prefill is not None:
                stub = wgrpc.PrefillWorkerStub(self._channel(placement.prefill.address))
                call = stub.Prefill(
                    wpb.PrefillRequest(
                        request_id=rid,
                        prompt_token_ids=tokens,
                        sampling=request.sampling,
                        decode_worker=placement.decode.worker_id,
                    ),
                    timeout=timeout,
                )
                active.call = call
                first = await call
                self._track_prefill(placement, -len(tokens))
                prefill_pending = False
                timings.first_token_ms = (time.perf_counter() - t_start) * 1e3
                usage.completion_tokens = 1
                usage.cached_prompt_tokens = first.num_cached_tokens
                yield rpb.GenerateResponse(
                    request_id=rid,
                    chunk=rpb.Chunk(
                        token_ids=[first.first_token_id], text=first.text, logprobs=first.logprobs
                    ),
                )
                if first.finished:
                    finished = True
                    yield self._complete(rid, first, usage, timings, t_start)
                    return
                decode_req.output_token_ids.append(first.first_token_id)
                decode_req.num_emitted_chars = len(first.text)
                decode_req.kv.CopyFrom(first.kv)
            stub_d = wgrpc.DecodeWorkerStub(self._channel(placement.decode.address))
            stream = stub_d.Decode(decode_req, timeout=context.time_remaining())
            active.call = stream
            async for msg in stream:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    if usage.completion_tokens == 0 and msg.chunk.token_ids:
                        timings.first_token_ms = (time.perf_counter() - t_start) * 1e3
                    usage.completion_tokens += len(msg.chunk.token_ids)
                    yield rpb.GenerateResponse(request_id=rid, chunk=msg.chunk)
                elif kind == "complete":
                    done = msg.complete
                    if not placement.disaggregated:
                        usage.cached_prompt_tokens = done.num_cached_tokens
                    timings.kv_transfer_ms = done.kv_transfer_ms
                    finished = True
                    yield self._complete(rid, done, usage, timings, t_start)
            if not finished:
                raise _Rejected(grpc.StatusCode.INTERNAL, "decode worker ended without a result")
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            # Abort() cancels the worker call; depending on where it lands that surfaces
            # as CancelledError or as a CANCELLED status. A client's own cancel re-raises.
            if not active.aborted:
                if isinstance(exc, asyncio.CancelledError):
                    raise
            else:
                finished = True
                yield rpb.GenerateResponse(
                    request_id=rid,
                    complete=rpb.Complete(
                        finish_reason=rpb.FINISH_REASON_ABORT, usage=usage, timings=timings
                    ),
                )
                return
            assert isinstance(exc, grpc.aio.AioRpcError)
            code, message = _worker_error(exc)
            yield rpb.GenerateResponse(
                request_id=rid, error=rpb.Error(code=code.value[0], message=message)
            )
            await convert.abort_rpc(context, code, message)
        except _Rejected as rej:
            yield rpb.GenerateResponse(
                request_id=rid, error=rpb.Error(code=rej.code.value[0], message=rej.message)
            )
            await convert.abort_rpc(context, rej.code, rej.message)
        finally:
            self._active.pop(rid, None)
            self._track_decode(placement, -1)
            if prefill_pending:
                self._track_prefill(placement, -len(tokens))
            if not finished or active.aborted:
                # Client cancelled, deadline passed, Abort, or a worker failed: stop both sides.
                self._spawn(self._abort_workers(rid, placement))

    def _complete(
        self,
        rid: str,
        result: wpb.PrefillResponse | wpb.DecodeComplete,
        usage: rpb.Usage,
        timings: rpb.Timings,
        t_start: float,
    ) -> rpb.GenerateResponse:
        """The final message of a finished request; its timings also go to the controller."""
        timings.total_ms = (time.perf_counter() - t_start) * 1e3
        if self._request_log is not None:
            n = usage.completion_tokens
            itl = (timings.total_ms - timings.first_token_ms) / (n - 1) if n > 1 else 0.0
            self._request_log.record(
                RequestSample(
                    t=time.time(),
                    ttft_ms=timings.first_token_ms,
                    itl_ms=itl,
                    prompt_tokens=usage.prompt_tokens,
                    output_tokens=n,
                    cached_tokens=usage.cached_prompt_tokens,
                    disaggregated=timings.disaggregated,
                )
            )
        return rpb.GenerateResponse(
            request_id=rid,
            complete=rpb.Complete(
                finish_reason=result.finish_reason,
                stop_reason=result.stop_reason,
                usage=usage,
                timings=timings,
            ),
        )

    def _track_decode(self, placement: Placement, sign: int) -> None:
        d = placement.decode.worker_id
        self._inflight_reqs[d] = self._inflight_reqs.get(d, 0) + sign

    def _track_prefill(self, placement: Placement, num_tokens: int) -> None:
        """Add (positive) or remove (negative) prompt tokens sent to the prefill worker."""
        if placement.prefill is not None:
            p = placement.prefill.worker_id
            self._inflight_tokens[p] = max(0, self._inflight_tokens.get(p, 0) + num_tokens)

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
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

    async def Tokenize(
        self, request: rpb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> rpb.TokenizeResponse:
        try:
            tokens, text = self._prompt(request)
        except _Rejected as rej:
            await convert.abort_rpc(context, rej.code, rej.message)
        return rpb.TokenizeResponse(token_ids=tokens, prompt=text)

    async def ListModels(
        self, request: rpb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> rpb.ListModelsResponse:
        return rpb.ListModelsResponse(
            models=[
                rpb.ModelInfo(
                    id=self.model_id,
                    max_model_len=self.max_model_len,
                    vocab_size=self.model_config.vocab_size,
                    block_size=self.config.block_size,
                )
            ]
        )

    async def Abort(
        self, request: rpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rpb.AbortResponse:
        active = self._active.get(request.request_id)
        if active is None:
            return rpb.AbortResponse(found=False)
        active.aborted = True
        if active.call is not None:
            active.call.cancel()
        return rpb.AbortResponse(found=True)


def _worker_error(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """Map a worker's failure to what the client should see."""
    code = exc.code()
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ):
        return code, exc.details() or code.name
    return grpc.StatusCode.UNAVAILABLE, f"worker failed ({code.name}: {exc.details()}); retry"
