"""A real Prometheus server (Debian's `prometheus`, scripts/ensure-prometheus.sh) scraping a
`tandem up` cluster every second: after a few requests, one of them long enough to be
disaggregated, the TTFT and KV-transfer histograms have samples, every target is up, and
every query of the Grafana dashboard (deploy/helm/tandem/dashboards/tandem.json) is valid
PromQL, the latency ones with data."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.client import TandemClient
from tandem.services.up import Cluster
from tests.services.processes import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/helm/tandem/dashboards/tandem.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
WAIT_S = 30.0


class Prometheus:
    """`prometheus` scraping `targets` (name -> host:port) every second."""

    def __init__(self, targets: dict[str, str], directory: Path) -> None:
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": "tandem",
                    "static_configs": [
                        {"targets": [address], "labels": {"process": name}}
                        for name, address in sorted(targets.items())
                    ],
                }
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (directory / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + WAIT_S
        while True:
            assert self.proc.poll() is None, f"prometheus exited: see {self.log.name}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready: see {self.log.name}"
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (AssertionError with Prometheus' message when it
        rejects the expression)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        assert body["status"] == "success", f"{expr!r}: {body.get('error')}"
        return list(body["data"]["result"])

    def value(self, expr: str) -> float:
        """The single value of a query (0 when it has no result yet)."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if not Path(PROMETHEUS).exists():
        pytest.skip(
            "no `prometheus` binary (Debian package prometheus: scripts/ensure-prometheus.sh, "
            "or `make deploy-tools`)"
        )
    server = Prometheus(cluster.metrics_addresses, tmp_path_factory.mktemp("prometheus"))
    try:
        yield server
    finally:
        server.stop()


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"after {WAIT_S:.0f} s: {what}"
        time.sleep(0.5)


def test_prometheus_scrapes_the_cluster(cluster: Cluster, prometheus: Prometheus) -> None:
    targets = cluster.metrics_addresses
    assert {"router", "prefill-0", "decode-0"} <= set(targets)

    rng = random.Random(16)
    with TandemClient(cluster.router_address) as client:
        results = [
            client.generate(rng.choices(range(5, 512), k=n), max_tokens=8, ignore_eos=True)
            for n in (150, 12, 20, 200)
        ]
    # The long prompts went through the prefill worker and a KV transfer.
    assert [r.disaggregated for r in results] == [True, False, False, True]

    _until(
        lambda: prometheus.value("sum(tandem_router_time_to_first_token_seconds_count)") >= 4,
        "no TTFT samples in Prometheus",
    )
    _until(
        lambda: prometheus.value("sum(tandem_worker_kv_transfer_seconds_count)") > 0,
        "no KV transfer samples in Prometheus",
    )
    assert prometheus.value("sum(tandem_worker_kv_transfer_bytes_total)") > 0
    assert prometheus.value('sum(tandem_worker_kv_transfers_total{outcome="committed"})') >= 2

    # Every target scraped, and up (a target's first scrape may come a moment later).
    def up() -> dict[str, str]:
        return {r["metric"]["process"]: r["value"][1] for r in prometheus.query('up{job="tandem"}')}

    _until(lambda: set(up()) == set(targets), f"not every target scraped: {up()}")
    assert up() == {name: "1" for name in targets}

    # Every dashboard query is valid PromQL; the TTFT quantiles have data for both paths.
    board = json.loads(DASHBOARD.read_text())
    exprs = [
        t["expr"]
        for p in board["panels"]
        for t in p.get("targets", [])
    ]  # fmt: skip
    assert exprs
    for expr in exprs:
        prometheus.query(_instant(expr))
    ttft_p90 = next(e for e in exprs if "histogram_quantile(0.9," in e and "first_token" in e)
    _until(
        lambda: (
            {r["metric"]["path"] for r in prometheus.query(_instant(ttft_p90))}
            == {"disaggregated", "colocated"}
        ),
        f"no data for {ttft_p90}",
    )


def _instant(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in: all namespaces (a `tandem up`
    cluster's series have no namespace label), a one-minute rate window."""
    return expr.replace("$namespace", ".*").replace("$__rate_interval", "1m")
