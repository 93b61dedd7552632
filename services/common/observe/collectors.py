"""Worker metrics read when scraped, not maintained: Prometheus collectors over engine state.

`EngineGauges` reads the engine's load (running and waiting requests, KV blocks) and its
preemptions; `ExpertRouting` reads a mixture-of-experts model's tokens per (layer, expert).
`WorkerMetrics` (tandem.services.common.observe.metrics) registers them on its registry; nothing is
computed on the engine's hot path for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tandem.load import Load


class EngineGauges(Collector):
    """Running, waiting and KV-block gauges, and the preemptions counter, read from the
    engine when scraped (a racy read from outside the engine thread, as the heartbeat's: fine
    for load figures)."""

    def __init__(self, role: str, stats: Callable[[], Load] | None) -> None:
        self.role = role
        self.stats = stats
        self._last: Load | None = None

    def collect(self) -> Iterable[Metric]:
        s = self._last
        if self.stats is not None:
            try:
                s = self._last = self.stats()
            except RuntimeError:  # a queue changed size under the read: last figures
                pass
        values = {
            "tandem_worker_requests_running": ("Requests in the engine's batch.",
                                               s.num_running if s else 0),
            "tandem_worker_requests_waiting": ("Requests waiting for the engine (or for KV).",
                                               s.num_waiting if s else 0),
            "tandem_worker_kv_blocks_used": ("KV cache blocks in use.",
                                             s.num_blocks - s.num_free_blocks if s else 0),
            "tandem_worker_kv_blocks_capacity": ("KV cache blocks.", s.num_blocks if s else 0),
        }  # fmt: skip
        for name, (doc, value) in values.items():
            family = GaugeMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family
        preemptions = CounterMetricFamily(
            "tandem_worker_preemptions",
            "Requests preempted since start: their KV blocks freed for others', the tokens "
            "recomputed when the request is scheduled again.",
            labels=["role"],
        )
        preemptions.add_metric([self.role], s.num_preemptions if s else 0)
        yield preemptions


class ExpertRouting(Collector):
    """Tokens routed per (layer, expert), read from the model when scraped."""

    def __init__(
        self, role: str, layers: tuple[int, ...], counts: Callable[[], list[list[int]]]
    ) -> None:
        self.role, self.layers, self.counts = role, layers, counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "tandem_worker_moe_routed_tokens",
            "Tokens routed to each expert of each sparse layer (a token counts once per "
            "expert it is routed to).",
            labels=["role", "layer", "expert"],
        )
        for layer, row in zip(self.layers, self.counts(), strict=True):
            for expert, n in enumerate(row):
                family.add_metric([self.role, str(layer), str(expert)], n)
        yield family
