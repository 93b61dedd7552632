"""The router: public Router gRPC service. Admit, tokenize, place, orchestrate, stream.

Generate -> admission (sync: id unique, max_inflight) -> id claim across routers (Redis)
         -> RequestSpec (length checked before tokenizing; tokenized off the event loop)
         -> Placer.place -> Hops.run: prefill hop, decode hop, recovery on worker faults
client cancel / deadline / Abort -> Abort on both workers
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from http.server import HTTPServer
from pathlib import Path

import grpc
from grpc_health.v1 import health

from tandem.engine.request import RequestSpec
from tandem.routing import Placement
from tandem.services.common import security
from tandem.services.common.observe import tracing
from tandem.services.common.observe.metrics import (
    RouterMetrics,
    start_metrics_server,
    stop_metrics_server,
)
from tandem.services.common.redis.request_ids import RequestIds
from tandem.services.common.redis.request_log import RequestLog
from tandem.services.common.rpc import errors
from tandem.services.common.rpc.errors import ServiceError, rpc
from tandem.services.common.runtime.process import start_grpc_server
from tandem.services.router.call import Call, CallContext, Timings, worker_request_id
from tandem.services.router.config import RouterConfig
from tandem.services.router.grpc_tools import CompleteCalls, complete_calls
from tandem.services.router.hops import Hops
from tandem.services.router.inputs import GenerateInput, Source
from tandem.services.router.links import Background, Links
from tandem.services.router.openai.http import OpenAIServer
from tandem.services.router.placer import Placer, ResumeMarks
from tandem.services.router.prompts import Prompts, check_request_id
from tandem.services.router.replies import Replies
from tandem.services.router.tenants import Tenants
from tandem.types import FinishReason
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc

log = logging.getLogger(__name__)
SERVICE_NAME = "tandem.v1.Router"

__all__ = ["RouterConfig", "RouterServer"]


class RouterServer(rgrpc.RouterServicer):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.model_id = config.model_id or config.model_dir.rstrip("/").split("/")[-1]
        self.prompts = Prompts(config.model_dir, self.model_id, config.tool_call_parser)
        self.tokenizer = self.prompts.tokenizer
        self.tool_format = self.prompts.tool_format
        self.model_config = self.prompts.model_config
        self.max_model_len = self.prompts.max_model_len
        self.metrics = RouterMetrics()
        self.background = Background()
        self.links = Links(config.auth, config.keepalive_s, self.metrics, self.background)
        self.replies = Replies(self.metrics)
        # A worker (re)joining the registry gets a fresh connection: the old one may sit in
        # reconnect backoff from the outage that took it out.
        self.placer = Placer(
            config,
            self.model_id,
            lambda w: self.links.retire(w.address),
            marks=ResumeMarks.of(self.model_config),
        )
        self.metrics.running.set_function(lambda: len(self._admitted))
        self.metrics.index_degraded.set_function(lambda: float(self.placer.index_degraded))
        self.metrics_address = ""  # host:port of /metrics, once started (metrics_port >= 0)
        self._metrics_server: HTTPServer | None = None
        self.tenants = Tenants(config.api_keys_file, config.shared_cache_tenants)
        self.hops = Hops(
            self.placer,
            self.links,
            self.replies,
            config.hop_timeout_s,
            config.recovery,
            config.routing.disagg_min_uncached_tokens,
            metrics=self.metrics,
        )
        self.server: grpc.aio.Server | None = None
        self.http: OpenAIServer | None = None  # the OpenAI HTTP API, when http_port >= 0
        self.health = health.aio.HealthServicer()
        self.address = ""
        # Keyed by (tenant, the client's id for the request): a tenant sees only its own.
        self._admitted: set[tuple[str, str]] = set()  # between admission and the end
        self._calls: dict[tuple[str, str], Call] = {}  # the placed ones
        self._early_aborts: set[tuple[str, str]] = set()  # Abort before placement
        self._request_log: RequestLog | None = None
        self._request_ids: RequestIds | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        tracing.setup_tracing("tandem-router", self.config.otlp_endpoint)
        log.info("router routing: %r, recovery: %r", self.config.routing, self.config.recovery)
        await self.placer.start()
        if self.config.redis_url:
            self._request_log = RequestLog(self.config.redis_url, self.model_id)
            await self._request_log.start()
            self.replies.request_log = self._request_log
            self._request_ids = RequestIds(self.config.redis_url, self.model_id)
        keyring = self.tenants.load_keyring()
        credentials = None
        if self.config.tls_cert_file:
            credentials = grpc.ssl_server_credentials(
                [
                    (
                        Path(self.config.tls_key_file).read_bytes(),
                        Path(self.config.tls_cert_file).read_bytes(),
                    )
                ]
            )
        self.server, port = await start_grpc_server(
            self.config.host,
            self.config.port,
            (SERVICE_NAME,),
            lambda server: rgrpc.add_RouterServicer_to_server(self, server),
            self.health,
            auth_rules={SERVICE_NAME: security.Bearer("generate")},
            auth=self.config.auth,
            keyring=keyring,
            credentials=credentials,
        )
        self.address = f"{self.config.host}:{port}"
        scheme = "TLS" if credentials else "plaintext"
        log.info("router serving %s on %s (%s)", self.model_id, self.address, scheme)
        if self.config.http_port >= 0:
            self.http = OpenAIServer(self, keyring)
            cfg = self.config
            await self.http.start(cfg.host, cfg.http_port, cfg.tls_cert_file, cfg.tls_key_file)
            log.info("router OpenAI API on %s://%s/v1", self.http.scheme, self.http.address)
        if self.config.metrics_port >= 0:
            self._start_metrics()

    def _start_metrics(self) -> None:
        """/metrics on host:metrics_port, and the worker gauges kept current for it."""
        self._metrics_server, port = start_metrics_server(
            self.config.host, self.config.metrics_port, self.metrics.registry
        )
        self.metrics_address = f"{self.config.host}:{port}"
        log.info("router metrics on http://%s/metrics", self.metrics_address)
        self.background.spawn(self._refresh_worker_gauges())

    async def _refresh_worker_gauges(self) -> None:
        while self._metrics_server is not None:
            self.metrics.set_workers(self.placer.worker_states())
            await asyncio.sleep(self.config.worker_refresh_s)

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        stop_metrics_server(self._metrics_server)
        self._metrics_server = None
        if self.server is not None:
            await self.server.stop(grace=2.0)
        # The requests the stop cut short are being aborted on their workers: let those
        # calls go out before the channels close.
        await self.background.wait(3.0)
        await self.placer.stop()
        if self._request_log is not None:
            await self._request_log.stop()
        if self._request_ids is not None:
            await self._request_ids.close()
        await self.links.close()
        self.prompts.close()

    # -- requests ---------------------------------------------------------------------------

    def _admit(self, key: tuple[str, str]) -> None:
        """Count the request in, atomically (no await between the checks and the count)."""
        if key in self._admitted:
            raise errors.already_exists(f"request_id {key[1]!r} is already running")
        if len(self._admitted) >= self.config.max_inflight:
            self.metrics.refusals["inflight"].inc()
            raise errors.resource_exhausted(
                f"router has {len(self._admitted)} requests in flight (max_inflight "
                f"{self.config.max_inflight}); retry later",
                retry_after_s=0.5,
            )
        self._admitted.add(key)

    # -- RPCs ------------------------------------------------------------------------------

    @rpc
    async def Generate(
        self, request: rpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.GenerateResponse]:
        calls: list[CompleteCalls] = []  # a chat with tools: the calls its answer makes

        def read(inp: GenerateInput) -> None:
            if (found := complete_calls(inp, self.tool_format)) is not None:
                calls.append(found)

        source = Source(request.request_id, functools.partial(self.prompts.read, request))
        async for response in self.generate(source, context, self.tenants.current(), read):
            for found in calls:
                found.see(response)
            yield response

    async def generate(
        self,
        source: Source,
        context: CallContext,
        tenant: str,
        on_read: Callable[[GenerateInput], None] | None = None,
    ) -> AsyncGenerator[rpb.GenerateResponse, None]:
        """One request of `tenant`, from admission to its last message: the gRPC API (its
        GenerateRequest read by `Prompts.read`) and the HTTP API (the input its parser read,
        tandem.services.router.openai.http) both serve through here, each input read once, here
        (tandem.services.router.inputs); `on_read` sees it once read. Raises ServiceError (after an
        in-stream Error message once the stream has started); cancelling the iteration (a
        client gone) aborts the request on both workers."""
        t_start = time.perf_counter()
        label = source.label
        if label:
            check_request_id(label)
        server_id = uuid.uuid4().hex  # the request's id on the workers and in logs
        rid = label or server_id  # what the client calls it
        key = (tenant, rid)
        try:
            self._admit(key)
        except ServiceError as refused:
            self.metrics.raised(refused, completed=False)
            raise
        span = tracing.start_span("tandem.generate", tracing.remote_parent(context))
        span.set_attribute("tandem.request_id", server_id)
        claimed = False
        claim = f"{tenant}/{label}"
        call: Call | None = None  # once placed
        try:
            if label and self._request_ids is not None:
                ttl = context.time_remaining() or self.config.request_id_ttl_s
                claimed = await self._request_ids.claim(claim, ttl + 1.0)
                if not claimed:
                    raise errors.already_exists(
                        f"request_id {rid!r} is already running (on another router)"
                    )
            if label or tenant:
                log.info("request %s: label %r, tenant %r", server_id, label, tenant)
            with tracing.span("tandem.tokenize", span):
                inp = await source.read()
                if on_read is not None:
                    on_read(inp)
                spec = await self.prompts.spec(
                    inp, server_id, context.time_remaining(), self.tenants.cache_salt(tenant)
                )
            span.set_attribute("tandem.prompt_tokens", spec.num_prompt_tokens)
            with tracing.span("tandem.route", span) as route_span:
                placement = await self.placer.place(spec, route_span)
            admission = self.placer.admission(spec, placement)
            if admission.estimate_s is not None:
                self.metrics.queue_delay_estimate.observe(admission.estimate_s)
            if not admission.admitted:
                self.metrics.refusals["queue_delay"].inc()
                log.info("request %s refused: %s", server_id, admission.reason)
                raise errors.resource_exhausted(admission.reason, admission.retry_after_s)
            call = self._calls[key] = self._open(spec, placement, t_start, rid, tenant)
            call.estimate_s = admission.estimate_s
            call.span = span
            try:
                if key in self._early_aborts:
                    call.aborted = True
                    raise asyncio.CancelledError
                async for response in self.hops.run(call, context):
                    yield response
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                # Abort() cancels the worker call; depending on where it lands that surfaces
                # as CancelledError or as a CANCELLED status. A client's own cancel re-raises.
                if call.aborted:
                    yield self.replies.complete(call, FinishReason.ABORT, "")
                    return
                if isinstance(exc, asyncio.CancelledError):
                    raise
                error = errors.from_worker(exc)
                yield self.replies.error(rid, error)
                raise error from None
            except ServiceError as error:
                yield self.replies.error(rid, error)
                raise
            finally:
                self._close(call)
                span.set_attribute("tandem.output_tokens", call.num_output_tokens)
        except BaseException as exc:
            tracing.fail(span, exc)
            self.metrics.raised(exc, completed=call is not None and call.finished)
            raise
        finally:
            span.end()
            self._admitted.discard(key)
            self._early_aborts.discard(key)
            if claimed and self._request_ids is not None:
                self.background.spawn(self._request_ids.release(claim))

    def _open(
        self, spec: RequestSpec, placement: Placement, t_start: float, public_id: str, tenant: str
    ) -> Call:
        timings = Timings(
            queue_ms=(time.perf_counter() - t_start) * 1e3,
            disaggregated=placement.disaggregated,
            prefill_worker=placement.prefill.worker_id if placement.prefill else "",
            decode_worker=placement.decode.worker_id,
            route_reason=placement.reason,
            route_cached_tokens=placement.cached_tokens,
            index_degraded=self.placer.index_degraded,
        )
        self.metrics.placed(placement, timings.queue_ms / 1e3)
        dispatch = self.placer.inflight.dispatch(placement, spec.num_prompt_tokens)
        return Call(
            spec, placement, dispatch, t_start, timings,
            worker_rid=worker_request_id(spec.request_id), public_id=public_id, tenant=tenant,
        )  # fmt: skip

    def _close(self, call: Call) -> None:
        self._calls.pop(call.key, None)
        call.dispatch.finish()
        self.metrics.tokens(
            call.spec.num_prompt_tokens, call.num_output_tokens, call.cached_prompt_tokens
        )
        if not call.finished or call.aborted:
            # Client cancelled, deadline passed, Abort, or a worker failed: stop both sides.
            self.links.abort(call.worker_rid, call.placement)

    @rpc
    async def Tokenize(
        self, request: rpb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> rpb.TokenizeResponse:
        tokens, text = await self.prompts.tokenize(request)
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
        key = (self.tenants.current(), request.request_id)
        call = self._calls.get(key)
        if call is None:
            if key in self._admitted:  # not placed yet
                self._early_aborts.add(key)
                return rpb.AbortResponse(found=True)
            # The same answer whether the id is unknown or another tenant's.
            raise errors.not_found(f"no running request {request.request_id!r}")
        call.aborted = True
        if call.worker_call is not None:
            call.worker_call.cancel()
        return rpb.AbortResponse(found=True)
