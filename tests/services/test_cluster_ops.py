"""Operating the cluster: reflection with grpcurl, discovery, drain, `tandem up`, capacity."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from tandem.client import TandemClient, TandemError
from tandem.weights.tiny import make_tiny_model
from tests.services.processes import alive, children_of

KV_BYTES = 64 << 20
GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ops") / "tiny", preset="tiny")


def generate_until(client: TandemClient, predicate, timeout_s: float = 30.0, **kwargs):
    """Send requests until one satisfies `predicate` (workers join asynchronously)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            result = client.generate([5, 6, 7], max_tokens=2, **kwargs)
            if predicate(result):
                return result
            last = (result.decode_worker, result.route_reason)
        except TandemError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE:
                raise
            last = exc
        assert time.monotonic() < deadline, f"condition never reached; last: {last!r}"
        time.sleep(0.1)


def test_grpcurl_lists_services_and_streams_generate(procs, model_dir, redis_server_private):
    worker, router, stop = procs.worker, procs.router, procs.stop
    url = redis_server_private.url
    dec, _ = worker("decode", model_dir, url, "d0")
    rtr, address = router(model_dir, url)
    try:
        with TandemClient(address) as client:
            generate_until(client, lambda r: True)
        listed = subprocess.run(
            [GRPCURL, "-plaintext", address, "list"], capture_output=True, text=True, timeout=30
        )
        assert listed.returncode == 0, listed.stderr
        assert {"tandem.v1.Router", "grpc.health.v1.Health"} <= set(listed.stdout.split())
        body = json.dumps(
            {"text": "hello", "sampling": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}}
        )
        call = subprocess.run(
            [GRPCURL, "-plaintext", "-d", body, address, "tandem.v1.Router/Generate"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert call.returncode == 0, call.stderr
        messages = [json.loads(m) for m in call.stdout.replace("}\n{", "}\x00{").split("\x00")]
        assert "chunk" in messages[0] and "complete" in messages[-1]
        assert messages[-1]["complete"]["usage"].get("completion_tokens") == 4, call.stdout
        streamed = [t for m in messages if "chunk" in m for t in m["chunk"]["token_ids"]]
        assert len(streamed) == 4
        health = subprocess.run(
            [GRPCURL, "-plaintext", address, "grpc.health.v1.Health/Check"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert '"SERVING"' in health.stdout
    finally:
        stop(rtr, dec)


def test_no_worker_is_unavailable_and_full_router_is_resource_exhausted(
    procs, model_dir, redis_server_private
):
    worker, router, stop = procs.worker, procs.router, procs.stop
    url = redis_server_private.url
    rtr, address = router(model_dir, url, "--max-inflight", "1")
    dec = None
    try:
        with TandemClient(address) as client:
            with pytest.raises(TandemError) as err:
                client.generate("hi", max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "no decode worker" in err.value.message
            dec, _ = worker("decode", model_dir, url, "d0")
            generate_until(client, lambda r: True)
            stream = client.stream([5] * 10, max_tokens=1500, ignore_eos=True)
            next(stream)  # the only slot is taken
            with pytest.raises(TandemError) as err:
                client.generate("hi", max_tokens=2)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight" in err.value.message
            stream.close()
            generate_until(client, lambda r: True)  # the slot frees when the stream ends
    finally:
        stop(rtr, *([dec] if dec else []))


def test_router_follows_joins_and_departures_and_drain_finishes_requests(
    procs, model_dir, redis_server_private
):
    worker, router, stop = procs.worker, procs.router, procs.stop
    url = redis_server_private.url
    d0, _ = worker("decode", model_dir, url, "d0")
    rtr, address = router(model_dir, url)
    d1 = None
    try:
        with TandemClient(address) as client:
            generate_until(client, lambda r: r.decode_worker == "d0")
            results: list[list[int]] = []
            started, release = threading.Event(), threading.Event()

            def long_request() -> None:
                # Read the first chunk, then hold the stream until released: the request stays
                # in flight on d0 however fast the tiny model generates (a request that had
                # already ended would leave d0 and d1 tied, and ties go to d0).
                tokens: list[int] = []
                for chunk in client.stream([5] * 8, max_tokens=2000, ignore_eos=True):
                    tokens.extend(chunk.token_ids)
                    if not started.is_set():
                        started.set()
                        release.wait(120)
                results.append(tokens)

            t = threading.Thread(target=long_request)
            t.start()
            assert started.wait(60)  # the long request is running on d0, the only worker
            d1, _ = worker("decode", model_dir, url, "d1")
            # d1 joins without a router restart and, being idle, gets the next requests
            generate_until(client, lambda r: r.decode_worker == "d1", timeout_s=90)
            # SIGTERM: d0 stops admitting, finishes its in-flight request, deregisters
            d0.send_signal(signal.SIGTERM)
            release.set()
            t.join(timeout=120)
            assert results and len(results[0]) == 2000
            assert d0.wait(timeout=30) == 0
            for _ in range(5):
                r = client.generate([5, 6], max_tokens=2)
                assert r.completion_tokens == 2 and r.decode_worker == "d1"
    finally:
        stop(rtr, d0, *([d1] if d1 else []))


def test_tandem_up_serves_and_ctrl_c_leaves_no_process(model_dir, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.services.cli",
            "up",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--kv-cache-mb",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops every process" in line:
                break
        out = "".join(lines)
        assert "demo:" in out and "Tandem is serving" in out
        address = re.search(r"127\.0\.0\.1:\d+", out).group(0)  # type: ignore[union-attr]
        children = children_of(proc.pid)
        assert len(children) >= 4  # redis, router, prefill, decode
        with TandemClient(address) as client:
            assert client.generate("hello", max_tokens=3).completion_tokens == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        left_behind = [pid for pid in children if alive(pid)]
        assert not left_behind, f"processes left behind: {left_behind}"
    finally:
        if proc.poll() is None:  # a failed assertion must not leave a cluster running
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
