"""Fixtures for service tests: one real Redis server shared by the whole session."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import redis

from tandem.client import TandemClient
from tandem.services.common.redis.server import RedisServer
from tandem.services.up import Cluster, UpConfig, wait_for_router
from tests.services.processes import stop


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


KV_BYTES = 64 << 20


def spawn(module: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Start `python -m module args`, wait for its READY line; return (process, address).
    Its stderr goes to a temporary file (a pipe nobody reads would fill and block it), whose
    tail is the failure's message when it never gets ready."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=err, text=True
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            err.seek(0)
            tail = err.read()[-3000:]
            raise AssertionError(f"{module} failed to start ({proc.returncode}): {line!r}\n{tail}")
    return proc, line.split()[-1]


def worker(role: str, model_dir: Path, redis_url: str, worker_id: str, *extra: str):
    return spawn(
        f"tandem.services.{role}",
        "--model-dir",
        str(model_dir),
        "--redis-url",
        redis_url,
        "--worker-id",
        worker_id,
        "--kv-cache-bytes",
        str(KV_BYTES),
        "--heartbeat-interval-s",
        "0.2",
        "--registry-ttl-s",
        "1.0",
        *extra,
    )


def router(model_dir: Path, redis_url: str, *extra: str):
    return spawn(
        "tandem.services.router",
        "--model-dir",
        str(model_dir),
        "--redis-url",
        redis_url,
        "--port",
        "0",
        "--worker-refresh-s",
        "0.1",
        *extra,
    )


@pytest.fixture
def redis_server_private() -> Iterator[RedisServer]:
    """A Redis of the test's own (for tests that kill or restart it)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def procs() -> SimpleNamespace:
    """Start service processes: procs.worker(role, model_dir, redis_url, id, *flags),
    procs.router(model_dir, redis_url, *flags) -> (process, address); procs.stop(*p)."""
    return SimpleNamespace(spawn=spawn, worker=worker, router=router, stop=stop)


@contextlib.contextmanager
def up_cluster(model_dir: Path, run_dir: Path, **overrides: object) -> Iterator[Cluster]:
    """A `tandem up` cluster (Redis, router, 1 prefill + 1 decode worker, router on a free
    port) that has answered a request; stopped on exit. `overrides`: UpConfig fields."""
    # float32: outputs are compared with in-process float32 references (tests/conftest.py).
    fields: dict[str, object] = {
        "port": 0, "http_port": 0, "kv_cache_bytes": KV_BYTES, "dtype": "float32",
    }  # fmt: skip
    config = UpConfig(
        model_dir=str(model_dir),
        run_dir=str(run_dir),
        **{**fields, **overrides},  # type: ignore[arg-type]
    )
    c = Cluster(config)
    c.start()
    try:
        wait_for_router(c.router_address)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def shared_cluster(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """One `tandem up` cluster for tests that only read what it exports (metrics, a
    Prometheus scraping it): they must not stop, kill or reconfigure its processes."""
    with up_cluster(tiny_model_dir, tmp_path_factory.mktemp("shared-run")) as c:
        yield c


# A module's `cluster` is the shared one unless the module defines its own; `client` (the
# real openai client over the router's HTTP API) and `grpc_client` (TandemClient) talk to it.
@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Cluster:
    return shared_cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    base_url = f"http://{cluster.http_address}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster: Cluster) -> Iterator[TandemClient]:
    with TandemClient(cluster.router_address, timeout_s=60) as c:
        yield c
