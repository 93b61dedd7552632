"""Per-request timings, from routers to the ratio controller, over a Redis stream.

Each router appends one entry per finished request (TTFT, mean ITL, prompt/output lengths,
cached prompt tokens, whether it was disaggregated) to the stream `tandem:requests:<model>`,
capped at `maxlen` entries. Writes are batched: `record()` only buffers, and a background task
flushes the buffer in one pipelined round trip every `flush_s`. While Redis is unreachable the
buffer keeps the newest `max_buffer` entries (one warning per outage); timings are telemetry,
so losing some during an outage is acceptable, blocking a request on them is not.

The controller reads the stream with `RequestLogReader.read_new()`, which returns the entries
added since its previous call.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.control import RequestSample
from tandem.services.common.runtime.process import cancel_and_wait

log = logging.getLogger(__name__)

STREAM_PREFIX = "tandem:requests:"
_FIELDS = ("t", "ttft_ms", "itl_ms", "prompt_tokens", "output_tokens", "cached_tokens")


def stream_key(model_id: str) -> str:
    return STREAM_PREFIX + model_id


def encode(sample: RequestSample) -> dict[str, str]:
    entry = {name: repr(getattr(sample, name)) for name in _FIELDS}
    entry["disaggregated"] = "1" if sample.disaggregated else "0"
    return entry


def decode(entry: dict[bytes, bytes]) -> RequestSample:
    """Parse a stream entry. Raises ValueError (or KeyError) on a malformed one."""
    f = {k.decode(): v.decode() for k, v in entry.items()}
    return RequestSample(
        t=float(f["t"]),
        ttft_ms=float(f["ttft_ms"]),
        itl_ms=float(f["itl_ms"]),
        prompt_tokens=int(f["prompt_tokens"]),
        output_tokens=int(f["output_tokens"]),
        cached_tokens=int(f["cached_tokens"]),
        disaggregated=f["disaggregated"] == "1",
    )


class RequestLog:
    """The router's writer. Use inside one event loop: start(), record()..., stop()."""

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        *,
        flush_s: float = 0.5,
        maxlen: int = 50_000,
        max_buffer: int = 10_000,
    ) -> None:
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._key = stream_key(model_id)
        self._flush_s = flush_s
        self._maxlen = maxlen
        self._buffer: deque[RequestSample] = deque(maxlen=max_buffer)
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def record(self, sample: RequestSample) -> None:
        self._buffer.append(sample)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="request-log")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self.flush()
        await self._redis.aclose()

    async def flush(self) -> None:
        """Write the buffered entries in one round trip (kept for later if Redis is down)."""
        if not self._buffer:
            return
        batch = list(self._buffer)
        pipe = self._redis.pipeline(transaction=False)
        for sample in batch:
            pipe.xadd(self._key, encode(sample), maxlen=self._maxlen, approximate=True)  # type: ignore[arg-type]
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            if not self._failing:
                self._failing = True
                log.warning("request timings cannot reach Redis (%s); buffering", exc)
            return
        if self._failing:
            self._failing = False
            log.warning("request timings reach Redis again")
        for _ in batch:
            self._buffer.popleft()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._flush_s)
            await self.flush()


class RequestLogReader:
    """The controller's reader: entries appended since the previous `read_new()`."""

    def __init__(self, redis: aioredis.Redis, model_id: str) -> None:
        self._redis = redis
        self._key = stream_key(model_id)
        self._last_id: bytes | None = None  # first read: only what comes after it

    async def read_new(self, limit: int = 10_000) -> list[RequestSample]:
        """Raises RedisError/OSError when Redis is unreachable."""
        if self._last_id is None:
            newest: Any = await self._redis.xrevrange(self._key, count=1)
            self._last_id = bytes(newest[0][0]) if newest else b"0-0"
            return []
        entries: Any = await self._redis.xrange(self._key, min=b"(" + self._last_id, count=limit)
        samples = []
        for entry_id, fields in entries or []:
            self._last_id = bytes(entry_id)
            try:
                samples.append(decode(fields))
            except (KeyError, ValueError) as exc:
                log.warning("skipping malformed request timing %r: %s", entry_id, exc)
        return samples
