"""Load-aware routing of new sessions and requests to engine replicas (a Ray Serve request router).

Every replica reports its load (`EngineReplica.record_routing_stats`, every `routing_stats_period_s`):
synthesis slots (`capacity`), utterances holding or waiting for one (`busy`), WebSocket sessions, and
whether its engine is healthy and keeping up. The router ranks replicas by that load:

1. replicas with a free slot, least loaded first (utterances per slot, then sessions per session limit);
2. full replicas (no free slot, or shedding load because they run behind real time), least loaded first;
3. replicas that are not ready or whose engine is down, last.

Serve walks the ranks in order and takes the first replica under its `max_ongoing_requests`. So a full
replica gets a session only when every replica is full, and then its admission queue answers (waits
for a slot, or `busy`) exactly as `serve` would.

Reports are a fraction of a second old, so between two reports of a replica the router adjusts its
last one by what it saw itself: each request it placed there counts as one more busy slot and session
(a burst of new sessions does not all land on the replica that looked idlest), and each of its requests
that ended there as one fewer (Serve's `on_request_completed`: the freed slot is used at once, not after
the next report). The adjustment is a guess between reports and never below zero; the next report
replaces it (a request that ended just before a report may count as ended twice until the one after).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

R = TypeVar("R")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's last report, plus what was sent to it since."""

    capacity: int  # synthesis slots (0: not reported yet)
    busy: int  # utterances synthesizing or waiting for a slot
    sessions: int
    max_sessions: int
    available: bool  # ready and its engine healthy
    overloaded: bool  # its engine refuses new streams: running behind real time

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any], sent_since: int = 0, ended_since: int = 0) -> ReplicaLoad:
        """From `record_routing_stats`'s dict, adjusted by the requests placed there and ended there since
        it was made; a replica that has not reported yet counts as idle."""
        change = sent_since - ended_since
        if not stats:
            return cls(capacity=0, busy=max(0, change), sessions=max(0, change), max_sessions=0, available=True,
                       overloaded=False)
        return cls(
            capacity=int(stats["capacity"]),
            busy=max(0, int(stats["busy"]) + change),
            sessions=max(0, int(stats["sessions"]) + change),
            max_sessions=int(stats["max_sessions"]),
            available=bool(stats["ready"]) and bool(stats["healthy"]),
            overloaded=bool(stats["overloaded"]),
        )

    @property
    def full(self) -> bool:
        return self.overloaded or (self.capacity > 0 and self.busy >= self.capacity)

    def key(self) -> tuple[int, float, float]:
        """Sort key: class (free, full, unavailable), then utterances per slot, then sessions per limit."""
        group = 2 if not self.available else 1 if self.full else 0
        per_slot = self.busy / self.capacity if self.capacity else float(self.busy)
        per_session = self.sessions / self.max_sessions if self.max_sessions else float(self.sessions)
        return group, round(per_slot, 6), round(per_session, 6)


def rank_by_load(replicas: Sequence[R], loads: Sequence[ReplicaLoad], *, rotation: int = 0) -> list[list[R]]:
    """Replicas in ranks of one, best first. Equally loaded replicas are ordered from `rotation` on, so
    requests routed at the same moment, before any of them counts in a load, still take turns."""
    pairs = list(zip(replicas, loads, strict=True))
    if pairs:
        shift = rotation % len(pairs)
        pairs = pairs[shift:] + pairs[:shift]
    pairs.sort(key=lambda pair: pair[1].key())  # stable: ties keep the rotated order
    return [[replica] for replica, _ in pairs]


@dataclass
class _SinceReport:
    """What one router saw of a replica since that replica's current report."""

    report_at: float | None
    placed: int = 0
    ended: int = 0


class LoadAwareRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router over the engine replicas' reported load (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._since_report: dict[ReplicaID, _SinceReport] = {}
        self._turn = 0

    def _seen(self, replica_id: ReplicaID) -> _SinceReport:
        """This router's counts since the replica's current report (reset when a new report arrives)."""
        replica = self.curr_replicas.get(replica_id)
        report_at = (replica.routing_stats or {}).get("at") if replica is not None else None
        seen = self._since_report.get(replica_id)
        if seen is None or seen.report_at != report_at:
            seen = self._since_report[replica_id] = _SinceReport(report_at)
        return seen

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        live = {r.replica_id for r in candidate_replicas}
        for gone in [rid for rid in self._since_report if rid not in live]:
            del self._since_report[gone]
        loads = []
        for replica in candidate_replicas:
            seen = self._seen(replica.replica_id)
            loads.append(ReplicaLoad.from_stats(replica.routing_stats or {}, seen.placed, seen.ended))
        self._turn += 1
        ranked = rank_by_load(candidate_replicas, loads, rotation=self._turn)
        if ranked:
            # Counted now, not once the request is sent: several requests are routed concurrently, each
            # choosing before any is sent. A choice that ends elsewhere is forgotten at the next report.
            self._seen(ranked[0][0].replica_id).placed += 1
        return ranked

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Serve's hook, run on the router's event loop once per request sent to a replica, when it ends
        (a WebSocket session when it closes; a request the replica refused, too, balancing its placing)."""
        if replica_id in self.curr_replicas:
            self._seen(replica_id).ended += 1
