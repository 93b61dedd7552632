"""`tandem up` supervision with real processes: SIGKILLed children come back and serve.

One cluster (Redis, router, 1 prefill, 1 decode) serves the module. The tests run in file
order and the give-up test comes last: it ends the cluster. Every wait is bounded.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis

from tandem.client import Result, TandemClient, TandemError
from tandem.services.common.redis.worker_info import KEY_PREFIX
from tandem.services.up import Child, Cluster
from tests.services.conftest import KV_BYTES, up_cluster
from tests.services.processes import alive, children_of

WAIT_S = 60.0
MAX_RESTARTS = 2


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with up_cluster(
        tiny_model_dir,
        tmp_path_factory.mktemp("run"),
        restart_backoff_s=0.1,
        restart_max_backoff_s=0.2,
        max_restarts=MAX_RESTARTS,
        restart_window_s=600.0,
    ) as c:
        yield c


class Stderr:
    """What the supervisor printed during one test (pytest's capture, read as it grows)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys
        self.text = ""

    def wait(self, pattern: str, timeout_s: float = WAIT_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            self.text += self._capsys.readouterr().err
            match = re.search(pattern, self.text, re.DOTALL)
            if match is not None:
                return match
            if time.monotonic() > deadline:
                pytest.fail(f"no {pattern!r} on stderr within {timeout_s:.0f} s:\n{self.text}")
            time.sleep(0.1)


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Stderr:
    return Stderr(capsys)


def child(cluster: Cluster, name: str) -> Child:
    [found] = [c for c in cluster.children if c.name == name]
    return found


def kill(cluster: Cluster, name: str) -> int:
    pid = child(cluster, name).proc.pid
    os.kill(pid, signal.SIGKILL)
    return pid


def generate_until(
    address: str, predicate: Callable[[Result], bool], timeout_s: float = WAIT_S
) -> Result:
    """Send fresh long prompts (never a cache hit, so they may be disaggregated) until one
    result satisfies `predicate`; UNAVAILABLE while the cluster recovers is retried."""
    rng = random.Random(0)
    deadline = time.monotonic() + timeout_s
    last: object = None
    with TandemClient(address, timeout_s=30) as client:
        while True:
            try:
                result = client.generate([rng.randrange(5, 200) for _ in range(80)], max_tokens=2)
                if predicate(result):
                    return result
                last = (result.prefill_worker, result.decode_worker, result.route_reason)
            except TandemError as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = exc
            if time.monotonic() > deadline:
                pytest.fail(f"no good generate within {timeout_s:.0f} s; last: {last!r}")
            time.sleep(0.2)


def both_workers(result: Result) -> bool:
    return (
        result.disaggregated
        and result.prefill_worker == "prefill-0"
        and result.decode_worker == "decode-0"
    )


def test_a_killed_decode_worker_is_restarted_under_its_name_and_serves(cluster, stderr):
    old_pid = kill(cluster, "decode-0")
    back = stderr.wait(
        rf"decode-0 \(pid {old_pid}\) killed by SIGKILL; restarting in 0\.1s \(restart 1\)"
        r".*decode-0 back \(pid (\d+)\)"
    )
    new = child(cluster, "decode-0")
    assert int(back.group(1)) == new.proc.pid != old_pid
    assert new.proc.poll() is None and new.ready_line.startswith("READY decode")
    generate_until(cluster.router_address, both_workers)
    header = "--- tandem up: restart 1 of decode-0 (the previous process killed by SIGKILL) ---"
    log = new.log_path.read_text()
    assert header in log and log.index(header) > 0, "the crashed process's log was truncated"


def test_a_worker_added_from_a_passing_thread_outlives_it_and_drains(cluster, stderr):
    """The controller adds workers from threads that end before the cluster stops; a child
    tied to such a thread would be SIGKILLed with it instead of drained."""
    starter = threading.Thread(target=cluster.add_worker, args=("decode",))
    starter.start()
    starter.join(60)
    added = cluster.workers("decode")[-1]
    assert added.name != "decode-0"
    r = redis.Redis.from_url(cluster.redis_url)
    try:
        deadline = time.monotonic() + 60
        while not r.exists(KEY_PREFIX + added.name):  # warmed up and registered
            assert added.proc.poll() is None, f"{added.name} died: {added.proc.returncode}"
            assert time.monotonic() < deadline, f"{added.name} never registered"
            time.sleep(0.1)
    finally:
        r.close()
    cluster.remove_worker("decode")  # the newest: SIGTERM, it drains and exits
    assert added.proc.wait(timeout=60) == 0


def test_a_killed_redis_comes_back_and_the_router_follows_the_new_one(cluster, stderr):
    url = cluster.redis_url
    old_pid = kill(cluster, "redis")
    back = stderr.wait(
        rf"redis \(pid {old_pid}\) killed by SIGKILL; restarting in 0\.1s.*redis back \(pid (\d+)\)"
    )
    assert int(back.group(1)) == child(cluster, "redis").proc.pid
    assert child(cluster, "redis").ready_line.endswith(f" at {url}")  # the same address
    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + WAIT_S
        want = {f"{KEY_PREFIX}prefill-0", f"{KEY_PREFIX}decode-0"}
        while (keys := {k.decode() for k in client.scan_iter(match=KEY_PREFIX + "*")}) != want:
            assert time.monotonic() < deadline, f"workers never re-registered; keys: {keys}"
            time.sleep(0.2)
    finally:
        client.close()
    generate_until(cluster.router_address, both_workers)
    # Serving alone would not show that the router reads the new Redis: its watcher keeps
    # the last snapshot through an outage. A decode worker that comes back on a new port
    # after the restart can only be reached through a fresh registry read.
    old_pid = kill(cluster, "decode-0")
    stderr.wait(rf"decode-0 \(pid {old_pid}\) killed by SIGKILL.*decode-0 back \(pid \d+\)")
    generate_until(cluster.router_address, both_workers)


def test_a_killed_router_comes_back_on_the_same_address(cluster, stderr):
    address = cluster.router_address
    old_pid = kill(cluster, "router")
    back = stderr.wait(rf"router \(pid {old_pid}\) killed by SIGKILL.*router back \(pid (\d+)\)")
    router = child(cluster, "router")
    assert int(back.group(1)) == router.proc.pid
    assert router.ready_line.split()[-1] == address == cluster.router_address
    generate_until(address, both_workers)


def test_too_many_crashes_stop_the_cluster_and_say_why(cluster, stderr):
    procs = [c.proc for c in cluster.children]
    redis_log = child(cluster, "redis").log_path
    for _ in range(MAX_RESTARTS + 1):  # earlier tests may have used some restarts already
        old_pid = kill(cluster, "redis")
        said = rf"redis \(pid {old_pid}\) killed by SIGKILL; "
        if stderr.wait(said + "(restarting|giving up)").group(1) == "giving up":
            break
        stderr.wait(said + r"restarting.*redis back \(pid \d+\)")
    failure = cluster.wait_failure(timeout_s=WAIT_S)
    assert failure is not None, "the supervisor never gave up"
    assert failure.startswith(f"redis (pid {old_pid}) killed by SIGKILL; giving up on it: ")
    assert f"{MAX_RESTARTS + 1} exits within 600 s (at most {MAX_RESTARTS} restarts" in failure
    assert failure.endswith(f"Its log: {redis_log}. Stopping the cluster.")
    stderr.wait(re.escape(failure))
    assert cluster.children == []
    assert all(p.poll() is not None for p in procs), "the cluster was not stopped"


class TandemUp:
    """`tandem up` in a session of its own (so a killpg is a terminal's Ctrl-C), its output
    collected by threads while the test waits for lines."""

    def __init__(self, model_dir: Path, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "tandem.services.cli", "up",
                "--model", str(model_dir),
                "--port", "0",
                "--num-prefill", "0",
                "--kv-cache-bytes", str(KV_BYTES),
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lines.extend, args=(stream,), daemon=True).start()

    def wait_err(self, pattern: str) -> re.Match[str]:
        deadline = time.monotonic() + WAIT_S
        while True:
            exited = self.proc.poll() is not None
            if exited:
                time.sleep(0.2)  # the reader threads catch up with what it wrote last
            if (match := re.search(pattern, "".join(self.err), re.DOTALL)) is not None:
                return match
            if exited or time.monotonic() > deadline:
                pytest.fail(f"no {pattern!r} from tandem up:\n{''.join(self.err)}")
            time.sleep(0.1)

    def serving(self) -> None:
        self.wait_err(r"ready in ")
        deadline = time.monotonic() + WAIT_S
        while not any("Ctrl-C stops every process" in line for line in self.out):
            assert self.proc.poll() is None, "".join(self.err)
            assert time.monotonic() < deadline, "no demo within the wait:\n" + "".join(self.err)
            time.sleep(0.1)

    def child(self, module: bytes) -> int:
        [pid] = [p for p in children_of(self.proc.pid) if module in _cmdline(p)]
        return pid

    def close(self) -> None:
        if self.proc.poll() is None:  # a failed assertion must not leave a cluster running
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def test_tandem_up_restarts_then_ctrl_c_stops_all_without_restarts(tiny_model_dir: Path):
    up = TandemUp(tiny_model_dir, "--restart-backoff-s", "0.1")
    try:
        up.serving()
        old_pid = up.child(b"tandem.services.decode")
        os.kill(old_pid, signal.SIGKILL)
        new_pid = int(
            up.wait_err(
                rf"decode-0 \(pid {old_pid}\) killed by SIGKILL; restarting in 0\.1s "
                r"\(restart 1\)\ndecode-0 back \(pid (\d+)\)"
            ).group(1)
        )
        children = children_of(up.proc.pid)
        assert new_pid in children and old_pid not in children
        os.killpg(up.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
        assert up.proc.wait(timeout=WAIT_S) == 0, "".join(up.err)
        up.wait_err(r"stopping \.\.\.\nstopped\n")
        assert "".join(up.err).count("restarting") == 1, "".join(up.err)
        time.sleep(0.5)
        assert not [pid for pid in children if alive(pid)], "processes left behind"
    finally:
        up.close()


def test_tandem_up_exits_1_when_it_gives_up(tiny_model_dir: Path) -> None:
    up = TandemUp(tiny_model_dir, "--max-restarts", "0")
    try:
        up.serving()
        redis_pid = up.child(b"tandem.services.common.redis.server")
        children = children_of(up.proc.pid)
        os.kill(redis_pid, signal.SIGKILL)
        assert up.proc.wait(timeout=WAIT_S) == 1, "".join(up.err)
        up.wait_err(
            rf"redis \(pid {redis_pid}\) killed by SIGKILL; giving up on it: 1 exits within "
            r"60 s \(at most 0 restarts allowed\)\. Its log: \S+/redis\.log\. Stopping the "
            r"cluster\.\nstopped\n"
        )
        assert "restarting" not in "".join(up.err)
        time.sleep(0.5)
        assert not [pid for pid in children if alive(pid)], "processes left behind"
    finally:
        up.close()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
