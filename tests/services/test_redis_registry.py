"""RedisServer lifecycle and worker discovery (Registry, Heartbeat, WorkerWatcher) against a
real Redis/Valkey server.

Async code runs under `asyncio.run` inside plain test functions (no pytest-asyncio). Waits are
behavioural ("until X holds, at most N s"), never assertions about how long something took.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from tandem.services.common.redis.registry import (
    KEY_PREFIX,
    Heartbeat,
    Registry,
    WorkerInfo,
    WorkerWatcher,
)
from tandem.services.common.redis.server import RedisServer, find_redis_server

REPO_ROOT = Path(__file__).resolve().parents[2]
REGISTRY_LOGGER = "tandem.services.common.redis.registry"
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0, what: str = ""
) -> None:
    """Poll `predicate` until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


def wait_sync(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached within {timeout_s} s: {what}")
        time.sleep(0.02)


def pid_gone(pid: int) -> bool:
    """True when no live process has this pid (a zombie awaiting its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:  # no procfs: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state in ("Z", "X")


def ping(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return bool(client.ping())
    finally:
        client.close()


def worker(worker_id: str, role: str = "prefill", model: str = "m", **kw: Any) -> WorkerInfo:
    kw.setdefault("epoch", 1)
    return WorkerInfo(
        worker_id=worker_id, role=role, address=f"{worker_id}:50051", model=model, **kw
    )


# -- RedisServer -----------------------------------------------------------------------


def test_find_redis_server_gives_an_executable() -> None:
    binary = find_redis_server()
    assert os.access(binary, os.X_OK), binary


def test_server_answers_ping_and_stop_leaves_nothing() -> None:
    server = RedisServer()
    with server:
        pid = server.pid
        assert pid is not None and not pid_gone(pid)
        assert server.url.startswith("unix://")
        assert ping(server.url)
        sock = Path(server.url.removeprefix("unix://"))
        assert sock.exists()
    assert server.pid is None
    assert pid_gone(pid)
    assert not sock.parent.exists(), "stop() must remove the temp dir"
    server.stop()  # idempotent


def test_server_on_tcp_port() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with RedisServer(port=port) as server:
        assert server.url == f"redis://127.0.0.1:{port}"
        assert ping(server.url)


def test_server_in_a_given_workdir_leaves_it_in_place(tmp_path: Path) -> None:
    with RedisServer(workdir=tmp_path) as server:
        assert server.url == f"unix://{tmp_path / 'redis.sock'}"
        assert ping(server.url)
    assert tmp_path.is_dir() and (tmp_path / "redis.log").exists()


def test_start_failure_reports_the_server_log(tmp_path: Path) -> None:
    server = RedisServer(unix_socket=tmp_path / "missing-dir" / "r.sock", workdir=tmp_path)
    with pytest.raises(RuntimeError, match="log tail") as info:
        server.start()
    assert "r.sock" in str(info.value)  # which address
    assert "No such file or directory" in str(info.value)  # the server's own complaint
    assert server.pid is None


def test_kill_and_restart_keep_the_address_and_lose_the_data() -> None:
    with RedisServer() as server:
        url = server.url
        client = redis.Redis.from_url(url)
        client.set("k", "v")
        old_pid = server.pid
        assert old_pid is not None
        server.kill()
        assert server.pid is None and pid_gone(old_pid)
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.restart()
        assert server.url == url
        assert client.get("k") is None  # no persistence
        client.close()


def test_misuse_raises_value_error() -> None:
    with pytest.raises(ValueError, match="70000"):
        RedisServer(port=70000)
    with pytest.raises(ValueError, match="unix_socket"):
        RedisServer(unix_socket="/tmp/" + "x" * 200)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_a_sigkilled_parent() -> None:
    script = (
        "import time\n"
        "from tandem.services.common.redis.server import RedisServer\n"
        "s = RedisServer().start()\n"
        "print(s.pid, s.url, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    line = parent.stdout.readline().split()
    assert len(line) == 2, f"parent printed {line!r}"
    pid, url = int(line[0]), line[1]
    try:
        assert not pid_gone(pid) and ping(url)
        parent.kill()
        parent.wait()
        wait_sync(lambda: pid_gone(pid), 5.0, f"redis child {pid} to die with its parent")
    finally:
        if not pid_gone(pid):
            os.kill(pid, signal.SIGKILL)
        parent.stdout.close()
        # The SIGKILLed parent could not clean up its temp dir.
        sock = Path(url.removeprefix("unix://"))
        if sock.parent.name.startswith("tandem-redis-"):
            for path in sock.parent.iterdir():
                path.unlink()
            sock.parent.rmdir()


def test_foreground_cli_runs_until_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.services.common.redis.server"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    try:
        assert "pid" in words and "at" in words, words
        pid = int(words[words.index("pid") + 1])
        url = words[words.index("at") + 1]
        assert ping(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert pid_gone(pid)
        assert not Path(url.removeprefix("unix://")).parent.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# -- WorkerInfo ------------------------------------------------------------------------


def test_worker_info_json_round_trip_and_validation() -> None:
    info = worker(
        "p0", num_blocks=10, num_free_blocks=4, draining=True, updated_at=12.5,
        busy_frac=0.5, tokens_per_s=1234.5, step_ms=20.25,
    )  # fmt: skip
    assert WorkerInfo.from_json(info.to_json()) == info
    assert WorkerInfo.from_json(info.to_json().encode()) == info
    # Newer workers may add fields; older readers ignore them.
    extended = info.to_json()[:-1] + ',"gpu":"h200"}'
    assert WorkerInfo.from_json(extended) == info

    for garbage in (b"\xff\xfe", "not json", "[1, 2]", '{"worker_id": "p0"}'):
        with pytest.raises(ValueError):
            WorkerInfo.from_json(garbage)
    bad_type = info.to_json().replace('"num_blocks":10', '"num_blocks":"10"')
    with pytest.raises(ValueError, match="num_blocks"):
        WorkerInfo.from_json(bad_type)
    with pytest.raises(ValueError, match="bogus"):
        worker("p0", role="bogus")
    with pytest.raises(ValueError, match="num_running"):
        worker("p0", num_running=-1)
    with pytest.raises(ValueError, match="worker_id"):
        worker("")
    with pytest.raises(ValueError, match="busy_frac"):
        worker("p0", busy_frac=-0.1)
    with pytest.raises(ValueError, match="tokens_per_s"):
        worker("p0", tokens_per_s="fast")


# -- Registry --------------------------------------------------------------------------


def test_register_and_list_with_filters(redis_url: str) -> None:
    async def body() -> None:
        registry = Registry(redis_url)
        try:
            before = time.time()
            await registry.register(worker("p0", "prefill", "llama"))
            await registry.register(worker("p1", "prefill", "qwen"))
            await registry.register(worker("d0", "decode", "llama", num_blocks=64))

            everyone = await registry.list_workers()
            assert [w.worker_id for w in everyone] == ["d0", "p0", "p1"]
            assert all(w.updated_at >= before for w in everyone)  # stamped on write
            assert everyone[0].num_blocks == 64
            prefill = await registry.list_workers(role="prefill")
            assert [w.worker_id for w in prefill] == ["p0", "p1"]
            llama = await registry.list_workers(model="llama")
            assert [w.worker_id for w in llama] == ["d0", "p0"]
            both = await registry.list_workers(role="decode", model="llama")
            assert [w.worker_id for w in both] == ["d0"]
            assert await registry.list_workers(role="decode", model="qwen") == []
            with pytest.raises(ValueError, match="router"):
                await registry.list_workers(role="router")
        finally:
            await registry.close()

    run(body())


def test_garbage_entries_are_skipped_with_one_warning(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=REGISTRY_LOGGER)

    async def body() -> None:
        registry = Registry(redis_url)
        try:
            await registry.register(worker("p0"))
            raw = redis.asyncio.Redis.from_url(redis_url)
            await raw.set(KEY_PREFIX + "junk", b"{not json")
            await raw.set(KEY_PREFIX + "liar", worker("someone-else").to_json())
            await raw.aclose()
            for _ in range(3):
                assert [w.worker_id for w in await registry.list_workers()] == ["p0"]
        finally:
            await registry.close()

    run(body())
    warnings = [r.getMessage() for r in caplog.records if r.name == REGISTRY_LOGGER]
    assert len(warnings) == 2, warnings  # one per bad key, not one per poll
    assert any("junk" in w for w in warnings) and any("liar" in w for w in warnings)


def test_ttl_expiry_removes_a_silent_worker(redis_url: str) -> None:
    async def body() -> None:
        registry = Registry(redis_url, ttl_s=1.0)
        try:
            await registry.register(worker("p0"))
            assert len(await registry.list_workers()) == 1
            await asyncio.sleep(1.5)  # no heartbeat: the key must lapse
            assert await registry.list_workers() == []
        finally:
            await registry.close()

    run(body())


def test_deregister(redis_url: str) -> None:
    async def body() -> None:
        registry = Registry(redis_url)
        try:
            await registry.register(worker("p0"))
            await registry.register(worker("d0", "decode"))
            await registry.deregister("p0")
            await registry.deregister("never-registered")  # no-op
            assert [w.worker_id for w in await registry.list_workers()] == ["d0"]
            with pytest.raises(ValueError):
                await registry.deregister("")
        finally:
            await registry.close()

    run(body())


# -- Heartbeat -------------------------------------------------------------------------


def test_heartbeat_refreshes_stats_and_deregisters_on_stop(redis_url: str) -> None:
    async def body() -> None:
        registry = Registry(redis_url, ttl_s=1.0)
        stats = {"num_running": 0}

        def info() -> WorkerInfo:
            return worker("d0", "decode", num_running=stats["num_running"])

        with pytest.raises(ValueError, match="interval_s"):
            Heartbeat(registry, info, interval_s=1.0)  # must beat within the TTL
        beat = Heartbeat(registry, info, interval_s=0.1)
        try:
            await beat.start()
            # Registered as soon as start() returns.
            assert [w.num_running for w in await registry.list_workers()] == [0]
            with pytest.raises(RuntimeError):
                await beat.start()

            stats["num_running"] = 7

            async def sees_new_stats() -> bool:
                return [w.num_running for w in await registry.list_workers()] == [7]

            await eventually(sees_new_stats, what="heartbeat to publish num_running=7")
            # Beats outlive the TTL: still registered after well over ttl_s.
            await asyncio.sleep(1.2)
            assert len(await registry.list_workers()) == 1

            await beat.stop()
            assert await registry.list_workers() == []
            await beat.stop()  # idempotent

            # stop(deregister=False) leaves the key to expire on its own.
            await beat.start()
            await beat.stop(deregister=False)
            assert len(await registry.list_workers()) == 1
        finally:
            await beat.stop()
            await registry.close()

    run(body())


# -- WorkerWatcher ---------------------------------------------------------------------


def test_two_watchers_agree_and_report_joins_and_departures(redis_url: str) -> None:
    async def body() -> None:
        registry = Registry(redis_url)
        events: list[list[tuple[list[str], list[str]]]] = [[], []]

        def recorder(i: int) -> Callable[[list[WorkerInfo], list[str]], None]:
            def on_change(joined: list[WorkerInfo], left: list[str]) -> None:
                events[i].append((sorted(w.worker_id for w in joined), sorted(left)))

            return on_change

        # Separate clients, as two router processes would have.
        watcher_registries = [Registry(redis_url) for _ in range(2)]
        watchers = [
            WorkerWatcher(r, interval_s=0.05, on_change=recorder(i))
            for i, r in enumerate(watcher_registries)
        ]
        try:
            assert all(w.stale for w in watchers)  # never polled yet
            await registry.register(worker("p0"))
            for w in watchers:
                await w.start()
            assert events == [[(["p0"], [])]] * 2
            assert not any(w.stale for w in watchers)

            await registry.register(worker("d0", "decode"))
            await registry.register(worker("d1", "decode"))
            for w in watchers:
                await w.refresh()
            assert watchers[0].snapshot() == watchers[1].snapshot()
            assert sorted(watchers[0].snapshot()) == ["d0", "d1", "p0"]

            await registry.deregister("d0")
            await registry.register(worker("p0", epoch=2))  # p0 restarted
            for w in watchers:
                await w.refresh()
                await w.refresh()  # nothing changed: no further callback
            assert watchers[0].snapshot() == watchers[1].snapshot()
            assert watchers[0].snapshot()["p0"].epoch == 2
            expected = [(["p0"], []), (["d0", "d1"], []), (["p0"], ["d0", "p0"])]
            assert events == [expected, expected]

            # The background loop picks up changes without refresh() too.
            await registry.register(worker("p9"))
            await eventually(
                lambda: all("p9" in w.snapshot() for w in watchers), what="watchers to see p9"
            )
        finally:
            for w in watchers:
                await w.stop()
            for r in [*watcher_registries, registry]:
                await r.close()

    run(body())


def test_redis_outage_and_restart(caplog: pytest.LogCaptureFixture) -> None:
    """Redis dies: the watcher keeps its snapshot (stale) and the heartbeat keeps trying.
    Redis comes back empty: both recover and the worker is registered again."""
    caplog.set_level(logging.WARNING, logger=REGISTRY_LOGGER)
    server = RedisServer().start()

    async def body() -> None:
        worker_registry = Registry(server.url, ttl_s=1.0, socket_timeout_s=0.5)
        router_registry = Registry(server.url, ttl_s=1.0, socket_timeout_s=0.5)
        beats = 0

        def info() -> WorkerInfo:
            nonlocal beats
            beats += 1
            return worker("d0", "decode", num_free_blocks=beats)

        beat = Heartbeat(worker_registry, info, interval_s=0.1)
        watcher = WorkerWatcher(router_registry, interval_s=0.1)
        try:
            await beat.start()
            await watcher.start()
            assert list(watcher.snapshot()) == ["d0"] and not watcher.stale

            server.kill()
            await eventually(lambda: watcher.stale, what="watcher to notice Redis is gone")
            assert list(watcher.snapshot()) == ["d0"]  # last snapshot kept
            beats_at_outage = beats
            await eventually(
                lambda: beats >= beats_at_outage + 3, what="heartbeat to keep retrying"
            )
            assert not beat.healthy

            server.restart()  # comes back with an empty keyspace
            await eventually(lambda: not watcher.stale, what="watcher to recover")

            async def registered_again() -> bool:
                return [w.worker_id for w in await router_registry.list_workers()] == ["d0"]

            await eventually(registered_again, what="heartbeat to re-register d0")
            assert beat.healthy
            await eventually(
                lambda: watcher.snapshot()["d0"].num_free_blocks > beats_at_outage,
                what="watcher to see post-restart stats",
            )
        finally:
            await beat.stop()
            await watcher.stop()
            await worker_registry.close()
            await router_registry.close()

    try:
        run(body())
    finally:
        server.stop()

    messages = [r.getMessage() for r in caplog.records if r.name == REGISTRY_LOGGER]
    # One warning per outage from each side, however many polls/beats failed.
    assert sum("cannot reach Redis" in m for m in messages) == 2, messages
    assert sum("reached Redis again" in m for m in messages) == 2, messages
