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

Reports are a fraction of a second old; to keep a burst of new sessions from all landing on the replica
that looked idlest, each request this router places counts as one more busy slot and one more session on
its replica until that replica's next report arrives.
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
    def from_stats(cls, stats: Mapping[str, Any], sent_since: int = 0) -> ReplicaLoad:
        """From `record_routing_stats`'s dict; a replica that has not reported yet counts as idle."""
        if not stats:
            return cls(capacity=0, busy=sent_since, sessions=sent_since, max_sessions=0, available=True, overloaded=False)
        return cls(
            capacity=int(stats["capacity"]),
            busy=int(stats["busy"]) + sent_since,
            sessions=int(stats["sessions"]) + sent_since,
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


class LoadAwareRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router over the engine replicas' reported load (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        # replica -> (timestamp of the report the count is relative to, requests sent since that report)
        self._sent: dict[ReplicaID, tuple[float | None, int]] = {}
        self._turn = 0

    def _sent_since_report(self, replica: RunningReplica) -> int:
        report_at = (replica.routing_stats or {}).get("at")
        at, count = self._sent.get(replica.replica_id, (None, 0))
        return count if at == report_at else 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        live = {r.replica_id for r in candidate_replicas}
        for gone in [rid for rid in self._sent if rid not in live]:
            del self._sent[gone]
        loads = [ReplicaLoad.from_stats(r.routing_stats or {}, self._sent_since_report(r)) for r in candidate_replicas]
        self._turn += 1
        ranked = rank_by_load(candidate_replicas, loads, rotation=self._turn)
        if ranked:
            # Counted now, not once the request is sent: several requests are routed concurrently, each
            # choosing before any is sent. A choice that ends elsewhere is forgotten at the next report.
            self._count_sent(ranked[0][0])
        return ranked

    def _count_sent(self, replica: RunningReplica) -> None:
        report_at = (replica.routing_stats or {}).get("at")
        self._sent[replica.replica_id] = (report_at, self._sent_since_report(replica) + 1)
