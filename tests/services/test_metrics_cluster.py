"""Every process of a `tandem up` cluster serves Prometheus /metrics: after a disaggregated
and a colocated request, each exposition has the families the dashboard reads, with samples,
and passes `promtool check metrics` (Debian's `prometheus`; `make deploy-tools` installs it).
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import TandemClient
from tandem.services.common.observe.metrics import metric_names
from tandem.services.up import Cluster

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster) -> Cluster:
    """The shared cluster after one disaggregated and one colocated request."""
    with TandemClient(shared_cluster.router_address) as client:
        long = client.generate(list(range(5, 205)), max_tokens=8, ignore_eos=True)
        short = client.generate([5, 6, 7], max_tokens=8, ignore_eos=True)
    assert long.disaggregated and not short.disaggregated
    return shared_cluster


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return resp.read().decode()


def samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    """The sum over the series of `name` whose labels include `labels`."""
    want = set(labels.items())
    matching = [v for (n, ls), v in found.items() if n == name and want <= ls]
    assert matching, f"no {name}{labels or ''} sample"
    return sum(matching)


def test_every_process_has_a_metrics_address_on_the_host(cluster: Cluster) -> None:
    addresses = cluster.metrics_addresses
    assert set(addresses) == {"router", "prefill-0", "decode-0"}
    assert all(a.startswith("127.0.0.1:") for a in addresses.values())
    assert len(set(addresses.values())) == 3


def test_router_metrics_after_both_paths(cluster: Cluster) -> None:
    text = scrape(cluster.metrics_addresses["router"])
    found = samples(text)
    names = {n for n, _ in found}
    assert metric_names("router") - names <= {"tandem_router_recoveries_total"}  # none yet
    ttft = "tandem_router_time_to_first_token_seconds_count"
    assert value(found, ttft) >= 2
    assert value(found, ttft, path="disaggregated") >= 1
    assert value(found, ttft, path="colocated") >= 1
    assert value(found, "tandem_router_inter_token_latency_seconds_count") >= 7
    assert value(found, "tandem_router_e2e_request_latency_seconds_count") >= 2
    assert value(found, "tandem_router_queue_seconds_count") >= 2
    decisions = "tandem_router_routing_decisions_total"
    assert value(found, decisions, path="disaggregated", reason="kv_affinity") >= 1
    assert value(found, decisions, path="colocated", reason="short_prompt") >= 1
    assert value(found, "tandem_router_requests_total", outcome="finished", code="OK") >= 2
    assert value(found, "tandem_router_prompt_tokens_total") >= 203
    assert value(found, "tandem_router_generation_tokens_total") >= 16
    assert value(found, "tandem_router_requests_running") == 0
    assert value(found, "tandem_router_prefix_index_degraded") == 0
    assert value(found, "tandem_router_workers", role="decode", state="healthy") == 1
    assert value(found, "tandem_router_workers", role="prefill", state="healthy") == 1
    assert value(found, "tandem_build_info", component="router") == 1


def test_worker_metrics_after_a_hand_off(cluster: Cluster) -> None:
    prefill = samples(scrape(cluster.metrics_addresses["prefill-0"]))
    decode = samples(scrape(cluster.metrics_addresses["decode-0"]))
    for role, found in (("prefill", prefill), ("decode", decode)):
        assert metric_names(role) <= {n for n, _ in found}, role
        assert value(found, "tandem_worker_kv_blocks_capacity", role=role) > 0
        assert value(found, "tandem_worker_step_seconds_count", role=role) > 0
        assert value(found, "tandem_worker_queue_seconds_count", role=role) >= 1
        assert value(found, "tandem_worker_prefix_cache_queried_tokens_total", role=role) > 0
        assert value(found, "tandem_worker_requests_running", role=role) == 0
        assert value(found, "tandem_build_info", component=role) == 1
    assert value(prefill, "tandem_worker_prefix_cache_queried_tokens_total") >= 200
    assert value(decode, "tandem_worker_kv_transfer_bytes_total") > 0
    assert value(decode, "tandem_worker_kv_transfer_seconds_count") >= 1
    assert value(decode, "tandem_worker_kv_transfers_total", outcome="committed") >= 1
    assert value(decode, "tandem_worker_kv_transfers_total", outcome="failed") == 0
    assert value(decode, "tandem_worker_kv_recomputed_total") == 0
    assert value(prefill, "tandem_worker_lease_expired_total") == 0


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        script = Path(__file__).parents[2] / "scripts" / "ensure-prometheus.sh"
        pytest.skip(f"promtool not installed: run {script} (or `make deploy-tools`)")
    return found


def test_every_exposition_passes_promtool(cluster: Cluster) -> None:
    tool = promtool()
    for name, address in cluster.metrics_addresses.items():
        text = scrape(address)
        run = subprocess.run(
            [tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        problems = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
        assert run.returncode == 0 and not problems, (name, run.returncode, problems)
