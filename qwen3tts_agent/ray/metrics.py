"""Prometheus metrics of every replica through the one endpoint: summed, and per replica.

Each replica keeps the server's own registry (`server/metrics.py`: the same families as `serve`) and
sends a snapshot of it every `PUSH_INTERVAL_S` to `MetricsHub`, a small deployment of the same
application. Whichever replica a scrape reaches answers from the hub (with its own live registry in
place of its last snapshot):

- `GET /metrics`: every family summed over the replicas, under the names `serve` uses, so dashboards and
  `benchmarks/serving/load.py` read a Serve deployment as one server;
- `GET /metrics/replicas`: the same families with a `replica` label per replica.

A replica silent for `STALE_AFTER_S` (dead, or removed by a scale-down) drops out of both, so summed
counters can step down then: Prometheus' `rate()` treats that as a counter reset. Ray's own metrics
(`ray_serve_*`: requests, latencies, replica health) are exported by each Ray node as usual.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

PUSH_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0
REPLICA_LABEL = "replica"


class MetricsHub:
    """The latest registry snapshot of each replica (a Serve deployment of one replica, no resources)."""

    def __init__(self) -> None:
        self._snapshots: dict[str, tuple[float, list[Metric]]] = {}

    def report(self, replica: str, families: list[Metric]) -> None:
        self._snapshots[replica] = (time.monotonic(), families)

    def forget(self, replica: str) -> None:
        self._snapshots.pop(replica, None)

    def snapshots(self) -> dict[str, list[Metric]]:
        """Snapshots of the replicas heard from within `STALE_AFTER_S`."""
        now = time.monotonic()
        for replica in [r for r, (at, _) in self._snapshots.items() if now - at > STALE_AFTER_S]:
            del self._snapshots[replica]
        return {replica: families for replica, (_, families) in self._snapshots.items()}


def merge(snapshots: Mapping[str, Iterable[Metric]], *, per_replica: bool) -> list[Metric]:
    """One family per name: samples summed over replicas (`per_replica`: kept apart by a `replica` label).

    Sums are right for every family the server has: counters, histogram buckets/sums/counts, and gauges
    of things held (streams, sessions, slots). A counter's `_created` timestamp takes the earliest.
    """
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for replica, replica_families in sorted(snapshots.items()):
        for family in replica_families:
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                labels = dict(sample.labels)
                if per_replica:
                    labels[REPLICA_LABEL] = replica
                key = (sample.name, tuple(sorted(labels.items())))
                if sample.name.endswith("_created"):
                    samples[key] = min(samples.get(key, sample.value), sample.value)
                else:
                    samples[key] = samples.get(key, 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, label_pairs), value in values[name].items():
            family.add_sample(sample_name, dict(label_pairs), value)
    return list(families.values())


class _Families:
    """A collector that yields fixed families (so `generate_latest` renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(families: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
