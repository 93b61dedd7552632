"""Fixtures for service tests: one real Redis server shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from services.common.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A started server on a private unix socket. Shared, so tests must not stop or kill it:
    tests about Redis dying start their own `RedisServer`."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the shared server, with its keyspace emptied so tests cannot see each other."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url
