"""Redis with a password (and an ACL user, and TLS) end to end.

Real processes: a RedisServer that requires AUTH, a prefill and a decode worker and a router
given its URL through TANDEM_REDIS_URL (never argv); requests are served, the prefix index
is consulted (the second prompt sharing a long prefix routes on cached tokens), and the
password appears in no log. A service with a wrong or missing password stops at start-up
naming the problem. The index's own lookup client speaks AUTH and TLS (through a TLS proxy
in front of Redis, with a certificate made here: the bundled server is built without TLS).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tandem.client import TandemClient, TandemError
from tandem.index import ApplyResult, IndexUnavailable
from tandem.services.common.redis.index import RedisPrefixIndex
from tandem.services.common.redis.registry import Registry, WorkerWatcher
from tandem.services.common.redis.resp import LookupClient
from tandem.services.common.redis.server import RedisServer
from tandem.services.common.redis.url import RedisAuthError, redact_url, with_credentials

KV_BYTES = 64 << 20
START_TIMEOUT_S = 60.0
MODEL = "m"


@pytest.fixture(scope="module", params=["password", "acl-user"])
def secured_redis(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    username = "tandem" if request.param == "acl-user" else None
    with RedisServer(password=secrets.token_urlsafe(24), username=username) as server:
        yield server


def _with_password(server: RedisServer, password: str) -> str:
    """The server's URL with another password (and the same ACL user, if any)."""
    username = server.url.split("//", 1)[1].split(":", 1)[0]
    return with_credentials(server.url, password, username)


def _commandstats(server: RedisServer) -> dict[str, int]:
    client = redis.Redis.from_url(server.url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


class Service:
    """`python -m module`, the Redis URL in its environment, stderr in a file."""

    def __init__(self, module: str, log: Path, redis_url: str, *args: str) -> None:
        self.log = log
        env = {**os.environ, "TANDEM_REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=env,
        )
        self.argv = " ".join(self.proc.args)  # type: ignore[arg-type]

    def ready(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), f"did not start: {self.log.read_text()[-3000:]}"
        return line.split()[-1]

    def exit_code(self, timeout_s: float = START_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"still running after {timeout_s:.0f} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _worker(role: str, model_dir: Path, log_dir: Path, url: str, worker_id: str) -> Service:
    return Service(
        f"tandem.services.{role}", log_dir / f"{worker_id}.log", url,
        "--model-dir", str(model_dir),
        "--worker-id", worker_id,
        "--kv-cache-bytes", str(KV_BYTES),
        "--heartbeat-interval-s", "0.2",
        "--registry-ttl-s", "1.0",
    )  # fmt: skip


def _router(model_dir: Path, log_dir: Path, url: str) -> Service:
    return Service(
        "tandem.services.router", log_dir / "router.log", url,
        "--model-dir", str(model_dir),
        "--port", "0",
        "--worker-refresh-s", "0.1",
        "--disagg-min-uncached-tokens", "0",
    )  # fmt: skip


def _until(predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "it") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.2)


def test_services_serve_through_a_redis_with_a_password(
    tiny_model_dir: Path, tmp_path: Path, secured_redis: RedisServer
) -> None:
    url = secured_redis.url
    password = url.split("@", 1)[0].rsplit(":", 1)[1]
    assert len(password) >= 24 and redact_url(url) == secured_redis.redacted_url
    assert password not in secured_redis.redacted_url
    services = [
        _worker("prefill", tiny_model_dir, tmp_path, url, "p0"),
        _worker("decode", tiny_model_dir, tmp_path, url, "d0"),
    ]
    try:
        for service in services:
            service.ready()
        services.append(_router(tiny_model_dir, tmp_path, url))
        address = services[-1].ready()
        for service in services:
            assert url not in service.argv and password not in service.argv
        rng = random.Random(0)
        prefix = rng.choices(range(5, 200), k=160)  # 10 blocks of 16
        before = _commandstats(secured_redis)
        with TandemClient(address, timeout_s=60) as client:

            def served() -> bool:
                try:
                    return client.generate([5, 6, 7], max_tokens=1).completion_tokens == 1
                except TandemError:
                    return False

            _until(served, what="the router serving")
            first = client.generate(prefix + [7, 8, 9], max_tokens=2, temperature=0.0)
            assert first.disaggregated and first.prefill_worker == "p0"
            # Once the prefill worker's events reach the index, the prefix routes on them.

            def routed_on_the_cache() -> bool:
                again = client.generate(prefix + [9, 8], max_tokens=2)
                return again.completion_tokens == 2 and again.route_cached_tokens >= 160

            _until(routed_on_the_cache, what="a lookup finding the cached prefix")
        after = _commandstats(secured_redis)
        assert after.get("mget", 0) > before.get("mget", 0)  # the lookups reached Redis
        assert after.get("auth", 0) > 0 or after.get("hello", 0) > 0
    finally:
        for service in reversed(services):
            service.stop()
    for service in services:
        log = service.log.read_text()
        assert password not in log, f"the password is in {service.log.name}"


@pytest.mark.parametrize("how", ["wrong password", "no password"])
@pytest.mark.parametrize(
    "module", ["tandem.services.decode", "tandem.services.router", "tandem.services.controller"]
)
def test_a_service_with_bad_credentials_stops_at_start_up(
    tiny_model_dir: Path, tmp_path: Path, secured_redis: RedisServer, module: str, how: str
) -> None:
    if how == "wrong password":
        url = _with_password(secured_redis, "not-the-password")
    else:
        url = "unix://" + secured_redis.url.split("@", 1)[1]
    if module == "tandem.services.router":
        service = _router(tiny_model_dir, tmp_path, url)
    elif module == "tandem.services.controller":
        service = Service(module, tmp_path / "controller.log", url, "--port", "0")
    else:
        service = _worker("decode", tiny_model_dir, tmp_path, url, "d-bad")
    code = service.exit_code()
    log = service.log.read_text()
    assert code != 0, log
    # Our message, then Redis's own reason (WRONGPASS / NOAUTH / HELLO without AUTH).
    assert "refused our credentials" in log, log[-3000:]
    assert "check the password" in log
    assert "not-the-password" not in log


def test_registry_and_index_raise_and_redact_on_bad_credentials(
    secured_redis: RedisServer,
) -> None:
    url = _with_password(secured_redis, "wrong-one")

    async def run() -> None:
        registry = Registry(url)
        watcher = WorkerWatcher(registry)
        with pytest.raises(RedisAuthError) as exc:
            await watcher.start()
        assert "wrong-one" not in str(exc.value) and "***" in str(exc.value)
        await registry.close()
        index = RedisPrefixIndex(url, socket_timeout_s=5.0)  # a loaded machine: no timeouts
        assert index.fast_lookup
        with pytest.raises(IndexUnavailable) as lookup_exc:
            await index.lookup(MODEL, [10])
        assert "AuthenticationError" in str(lookup_exc.value)
        assert "wrong-one" not in str(lookup_exc.value) and "***" in str(lookup_exc.value)
        await index.close()

    asyncio.run(run())


# -- TLS: the lookup client and redis-py through a TLS proxy ---------------------------------


def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


class TlsProxy:
    """TLS on 127.0.0.1:<port> in front of a Redis UNIX socket, in a thread of its own."""

    def __init__(self, cert: Path, key: Path, unix_path: str) -> None:
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(cert, key)
        self._unix_path = unix_path
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._context)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(self._unix_path)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_the_lookup_client_speaks_tls_and_auth(tmp_path: Path, secured_redis: RedisServer) -> None:
    cert, key = _certificate(tmp_path)
    proxy = TlsProxy(cert, key, secured_redis.url.split("@", 1)[1])
    userinfo = secured_redis.url.split("//", 1)[1].split("@", 1)[0]
    url = f"rediss://{userinfo}@localhost:{proxy.port}/0?ssl_ca_certs={cert}"
    untrusted = f"rediss://{userinfo}@localhost:{proxy.port}/0"
    try:
        assert LookupClient.for_url(url, 1.0) is not None
        assert LookupClient.for_url(untrusted, 1.0) is not None  # default CA store: no trust

        async def run() -> None:
            index = RedisPrefixIndex(url, socket_timeout_s=5.0)  # a loaded machine: no timeouts
            assert index.fast_lookup  # TLS does not fall back to redis-py
            assert await index.snapshot("w0", MODEL, 1, 1, [10, 11]) is ApplyResult.APPLIED
            assert await index.lookup(MODEL, [10, 11, 12]) == {"w0": 2}
            await index.remove_worker("w0")
            await index.close()
            slow = RedisPrefixIndex(url, socket_timeout_s=5.0, fast_lookup=False)  # redis-py
            assert await slow.lookup(MODEL, [10, 11, 12]) == {}
            await slow.close()
            bad = RedisPrefixIndex(untrusted, socket_timeout_s=5.0)
            with pytest.raises(IndexUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                await bad.lookup(MODEL, [10])
            await bad.close()

        asyncio.run(run())
    finally:
        proxy.close()
