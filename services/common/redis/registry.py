"""Worker discovery over Redis with TTL heartbeats.

Each prefill/decode worker keeps one key, `tandem:worker:<worker_id>`, holding its `WorkerInfo`
as JSON with an expiry of `ttl_s`. A live worker rewrites it every heartbeat (with fresh load
stats), so the key exists exactly while the worker is alive and reachable from Redis; a worker
that crashes vanishes after at most `ttl_s`. Routers poll the keys with a `WorkerWatcher` to
follow joins and departures without restarting.

Redis is soft state here: losing it (or restarting it empty) loses nothing that heartbeats do
not rewrite within one interval, and both `Heartbeat` and `WorkerWatcher` ride out outages.
Wrong credentials are not an outage: when Redis refuses the URL's password (NOAUTH,
WRONGPASS, NOPERM) on the first beat or poll, `start()` raises `RedisAuthError`, so a
misconfigured service stops at start-up saying so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tandem.services.common.redis.url import RedisAuthError, is_auth_error
from tandem.services.common.redis.worker_info import KEY_PREFIX, WorkerInfo
from tandem.types import Role

# WorkerInfo and its key prefix are re-exported: callers import them from here.
__all__ = ["KEY_PREFIX", "Heartbeat", "Registry", "WorkerInfo", "WorkerWatcher"]

logger = logging.getLogger(__name__)

# Errors that mean "Redis is unreachable or misbehaving" rather than a bug on our side.
_REDIS_DOWN = (RedisError, OSError)


class Registry:
    """The set of registered workers in one Redis.

    `ttl_s` is how long a registration lives without being refreshed. Every method talks to
    Redis and raises `redis.exceptions.RedisError` (or OSError) when it is unreachable; callers
    that must survive outages use `Heartbeat`/`WorkerWatcher`. Client-level retries are limited
    to one immediate reconnect (which handles a pooled connection killed by a Redis restart):
    those two classes do their own, paced, retrying.

    The client binds to the event loop it is first used in; create, use and `close()` a
    Registry inside one loop.
    """

    def __init__(self, redis_url: str, ttl_s: float = 5.0, *, socket_timeout_s: float = 2.0):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
        self._url = redis_url
        self._ttl_s = ttl_s
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        # Keys already warned about as garbage, so a 2 Hz watcher does not flood the log.
        self._garbage_warned: set[bytes] = set()

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    @property
    def redis_url(self) -> str:
        return self._url

    async def register(self, info: WorkerInfo) -> None:
        """Write `info` (with `updated_at` set to now) under its key, expiring after `ttl_s`."""
        stamped = dataclasses.replace(info, updated_at=time.time())
        await self._redis.set(stamped.key, stamped.to_json(), px=max(1, round(self._ttl_s * 1e3)))

    async def deregister(self, worker_id: str) -> None:
        """Remove a worker's registration; a no-op when it is not registered."""
        if not worker_id:
            raise ValueError(f"worker_id must be non-empty, got {worker_id!r}")
        await self._redis.delete(KEY_PREFIX + worker_id)

    async def list_workers(
        self, role: str | None = None, model: str | None = None
    ) -> list[WorkerInfo]:
        """All registered workers, optionally only one role and/or model, sorted by id.

        One SCAN pass plus one MGET: keys that expire in between are skipped, as are values
        that do not parse (with a warning, once per key).
        """
        if role is not None and role not in tuple(Role):
            names = tuple(map(str, Role))
            raise ValueError(f"role must be one of {names} or None, got {role!r}")
        # SCAN may report a key twice; dict.fromkeys dedups while keeping order.
        keys: list[bytes] = list(
            dict.fromkeys(
                [k async for k in self._redis.scan_iter(match=KEY_PREFIX + "*", count=1000)]
            )
        )
        if not keys:
            return []
        values = await self._redis.mget(keys)
        workers: list[WorkerInfo] = []
        for key, raw in zip(keys, values, strict=True):
            if raw is None:
                continue  # expired or deregistered between SCAN and MGET
            try:
                info = WorkerInfo.from_json(raw)
                if info.key.encode() != key:
                    raise ValueError(f"holds worker_id {info.worker_id!r}")
            except ValueError as exc:
                if key not in self._garbage_warned:
                    self._garbage_warned.add(key)
                    logger.warning("ignoring malformed registry entry %r: %s", key, exc)
                continue
            self._garbage_warned.discard(key)
            if (role is None or info.role == role) and (model is None or info.model == model):
                workers.append(info)
        workers.sort(key=lambda w: w.worker_id)
        return workers

    async def close(self) -> None:
        await self._redis.aclose()


async def _wait_or_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to `timeout_s`; True when `stop` was set meanwhile."""
    if stop.is_set():
        return True  # wait_for with a zero timeout would not notice
    try:
        await asyncio.wait_for(stop.wait(), timeout=max(0.0, timeout_s))
    except TimeoutError:
        return False
    return True


class Heartbeat:
    """Keeps one worker registered while it lives.

    Every `interval_s` it calls `info_fn()` for fresh stats and registers the result;
    `interval_s` must be shorter than the registry's TTL or the key would lapse between beats.
    When Redis is unreachable it logs one warning, keeps beating at the same pace, and logs
    again when a beat succeeds (which also re-registers a worker whose key a Redis restart
    lost). Exceptions from `info_fn` are logged and the beat skipped, except on the first
    beat in `start()`, where they propagate so that bugs fail fast.
    """

    def __init__(
        self,
        registry: Registry,
        info_fn: Callable[[], WorkerInfo],
        interval_s: float = 1.0,
    ) -> None:
        if not 0 < interval_s < registry.ttl_s:
            raise ValueError(f"interval_s must be in (0, ttl_s={registry.ttl_s}), got {interval_s}")
        self._registry = registry
        self._info_fn = info_fn
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._worker_id: str | None = None
        self._failing = False

    @property
    def healthy(self) -> bool:
        """Whether the latest beat reached Redis."""
        return self._task is not None and not self._failing

    async def start(self) -> None:
        """Register once now (an unreachable Redis is logged, not raised), then keep beating.

        Raises:
            RedisAuthError: Redis refused the credentials in the registry's URL.
        """
        if self._task is not None:
            raise RuntimeError(f"Heartbeat for {self._worker_id!r} already started")
        self._stop = asyncio.Event()
        await self._beat(first=True)
        self._task = asyncio.create_task(self._run(), name=f"heartbeat:{self._worker_id}")

    async def stop(self, deregister: bool = True) -> None:
        """Stop beating (letting an in-flight beat finish, so none lands after the
        deregistration) and, if `deregister`, remove the key now instead of waiting for it to
        expire. Never raises for Redis being down. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            self._stop.set()
            await task
        if deregister and self._worker_id is not None:
            try:
                await self._registry.deregister(self._worker_id)
            except _REDIS_DOWN as exc:
                logger.warning(
                    "could not deregister worker %s (%s); its key expires within %.1f s",
                    self._worker_id, exc, self._registry.ttl_s,
                )  # fmt: skip

    async def _beat(self, first: bool = False) -> None:
        info = self._info_fn()
        self._worker_id = info.worker_id
        try:
            await self._registry.register(info)
        except _REDIS_DOWN as exc:
            if first and is_auth_error(exc):
                raise RedisAuthError.of(self._registry.redis_url, exc) from None
            if not self._failing:
                self._failing = True
                logger.warning(
                    "heartbeat for worker %s cannot reach Redis (%s); retrying every %.1f s",
                    info.worker_id, exc, self._interval_s,
                )  # fmt: skip
            return
        if self._failing:
            self._failing = False
            logger.warning("heartbeat for worker %s reached Redis again", info.worker_id)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self._interval_s
            if await _wait_or_stop(self._stop, next_at - loop.time()):
                return
            try:
                await self._beat()
            except Exception:
                logger.exception("heartbeat for worker %s failed", self._worker_id)
            # After a slow beat (Redis timing out) keep the cadence from now, not bursting.
            next_at = max(next_at, loop.time())


class WorkerWatcher:
    """A router's view of the registered workers, polled every `interval_s`.

    `on_change(joined, left_ids)` is called after a poll that saw workers appear or disappear;
    a worker whose epoch changed (it restarted) is reported in both. The first successful poll
    reports every worker as joined. Exceptions from `on_change` are logged, not raised.

    During a Redis outage the last snapshot is kept and `stale` is True (one warning per
    outage); polling continues and recovers by itself. Because a restarted Redis comes back
    empty, for one TTL after an outage workers missing from Redis are kept in the snapshot,
    giving their heartbeats time to re-register them instead of reporting everyone as left
    and rejoined. `stale` is also True before the first successful poll.
    """

    def __init__(
        self,
        registry: Registry,
        interval_s: float = 0.5,
        on_change: Callable[[list[WorkerInfo], list[str]], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._registry = registry
        self._interval_s = interval_s
        self._on_change = on_change
        self._snapshot: dict[str, WorkerInfo] = {}
        self._stale = True
        self._ever_fresh = False
        self._outage_logged = False
        self._grace_until = 0.0  # monotonic; see class docstring
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def stale(self) -> bool:
        """True while the snapshot may be out of date (Redis unreachable, or never polled)."""
        return self._stale

    def snapshot(self) -> dict[str, WorkerInfo]:
        """The latest known workers by id (a copy; safe to keep)."""
        return dict(self._snapshot)

    async def start(self) -> None:
        """Poll once now (so the snapshot is populated on return if Redis is up), then keep
        polling in the background.

        Raises:
            RedisAuthError: Redis refused the credentials in the registry's URL.
        """
        if self._task is not None:
            raise RuntimeError("WorkerWatcher already started")
        self._stop = asyncio.Event()
        await self._refresh(first=True)
        self._task = asyncio.create_task(self._run(), name="worker-watcher")

    async def stop(self) -> None:
        """Stop polling; the last snapshot stays readable. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            self._stop.set()
            await task

    async def refresh(self) -> None:
        """Poll Redis once now and update the snapshot (or mark it stale)."""
        await self._refresh()

    async def _refresh(self, first: bool = False) -> None:
        async with self._lock:  # the loop and a caller's refresh() must not interleave diffs
            try:
                workers = await self._registry.list_workers()
            except _REDIS_DOWN as exc:
                if first and is_auth_error(exc):
                    raise RedisAuthError.of(self._registry.redis_url, exc) from None
                self._stale = True
                if not self._outage_logged:
                    self._outage_logged = True
                    logger.warning(
                        "worker watcher cannot reach Redis (%s); keeping the last snapshot "
                        "of %d workers", exc, len(self._snapshot),
                    )  # fmt: skip
                return
            now = time.monotonic()
            if self._stale and self._ever_fresh:
                self._grace_until = now + self._registry.ttl_s
            if self._outage_logged:
                self._outage_logged = False
                logger.warning("worker watcher reached Redis again")
            self._stale = False
            self._ever_fresh = True

            old = self._snapshot
            new = {w.worker_id: w for w in workers}
            if now < self._grace_until:
                for worker_id, info in old.items():
                    new.setdefault(worker_id, info)
            left = [wid for wid, w in old.items() if wid not in new or new[wid].epoch != w.epoch]
            joined = [w for wid, w in new.items() if wid not in old or old[wid].epoch != w.epoch]
            self._snapshot = new
            # Inside the lock, so callbacks see changes in the order the snapshots were taken.
            if (joined or left) and self._on_change is not None:
                try:
                    self._on_change(joined, left)
                except Exception:
                    logger.exception("WorkerWatcher on_change callback failed")

    async def _run(self) -> None:
        while not await _wait_or_stop(self._stop, self._interval_s):
            try:
                await self.refresh()
            except Exception:
                logger.exception("worker watcher poll failed")
