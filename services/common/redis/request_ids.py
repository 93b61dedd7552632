"""Client-supplied request ids, unique across every router of a deployment.

A router claims an id before it places the request (`SET key owner NX PX ttl`) and releases
it when the request ends (delete only if it still holds the claim: a script, so a late
release never frees another router's claim). A second router given the same id while the
first runs sees the claim and answers ALREADY_EXISTS.

Redis is a coordination aid here, not a dependency of serving: when it cannot answer within
`timeout_s` the claim is granted (each router still refuses ids it runs itself) and
`degraded` says so. The ttl bounds how long a crashed router's claims outlive it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

KEY_PREFIX = "tandem:rid:"
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def claim_key(model_id: str, request_id: str) -> str:
    return f"{KEY_PREFIX}{model_id}:{request_id}"


class RequestIds:
    def __init__(self, redis_url: str, model_id: str, timeout_s: float = 0.2) -> None:
        self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._model_id = model_id
        self._owner = uuid.uuid4().hex  # this router's incarnation
        self._timeout_s = timeout_s
        self.degraded = False

    async def claim(self, request_id: str, ttl_s: float) -> bool:
        """True when this router now holds `request_id` (or Redis could not say)."""
        key = claim_key(self._model_id, request_id)
        try:
            won = await asyncio.wait_for(
                self._redis.set(key, self._owner, nx=True, px=max(1, int(ttl_s * 1e3))),
                self._timeout_s,
            )
        except (RedisError, OSError, TimeoutError) as exc:
            if not self.degraded:
                log.warning("request-id claims unavailable (%s): ids checked per router", exc)
                self.degraded = True
            return True
        if self.degraded:
            log.info("request-id claims available again")
            self.degraded = False
        return bool(won)

    async def release(self, request_id: str) -> None:
        key = claim_key(self._model_id, request_id)
        try:
            script = self._redis.eval(_RELEASE, 1, key, self._owner)
            await asyncio.wait_for(script, self._timeout_s)
        except (RedisError, OSError, TimeoutError):
            pass  # the ttl frees it

    async def close(self) -> None:
        await self._redis.aclose()
