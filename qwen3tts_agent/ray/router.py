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

Reports are a fraction of a second old, so between two reports of a replica the router adds to its
last one what it placed there since: each request counts as one more busy slot and session, so a burst
of new sessions does not all land on the replica that looked idlest. A request placed since the report
that has already ended (a readiness probe, a metrics scrape, a short HTTP utterance, one the replica
refused: Serve's `on_request_completed`) is taken back at once. One that ended after the next report is
left to the report after, which no longer counts it: the router cannot tell whether a report counted a
request (it counts utterances and WebSocket sessions, not other requests), so it never subtracts from one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
        """From `record_routing_stats`'s dict plus the requests placed there since it was made (and not
        ended yet); a replica that has not reported yet counts as idle."""
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


def rank_by_load(replicas: Sequence[R], loads: Sequence[ReplicaLoad], last_chosen: Sequence[int]) -> list[list[R]]:
    """Replicas in ranks of one, best first. Equally loaded replicas go least recently chosen first
    (`last_chosen`: when the router last ranked each first; lower is longer ago), so requests routed before
    any of them counts in a load, or whose load is gone before the next one, still take turns."""
    order = sorted(range(len(replicas)), key=lambda i: (loads[i].key(), last_chosen[i]))
    return [[replicas[i]] for i in order]


@dataclass
class _SinceReport:
    """The requests one router placed on a replica since that replica's current report, not ended yet."""

    report_at: float | None
    placed: set[str] = field(default_factory=set)  # Serve's internal request ids
    unnamed: int = 0  # placed without a request to name (Serve passes none in some calls)

    @property
    def count(self) -> int:
        return len(self.placed) + self.unnamed


class LoadAwareRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router over the engine replicas' reported load (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._since_report: dict[ReplicaID, _SinceReport] = {}
        self._placed_on: dict[str, ReplicaID] = {}  # request id -> the replica it was last placed on
        self._choices = 0  # how many times this router has chosen
        self._last_chosen: dict[ReplicaID, int] = {}  # replica -> the choice that last ranked it first

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
        for gone in [rid for rid in self._last_chosen if rid not in live]:
            del self._last_chosen[gone]
        loads = [
            ReplicaLoad.from_stats(replica.routing_stats or {}, self._seen(replica.replica_id).count)
            for replica in candidate_replicas
        ]
        last_chosen = [self._last_chosen.get(replica.replica_id, -1) for replica in candidate_replicas]
        ranked = rank_by_load(candidate_replicas, loads, last_chosen)
        if ranked:
            self._choices += 1
            self._last_chosen[ranked[0][0].replica_id] = self._choices
            # Counted now, not once the request is sent: several requests are routed concurrently, each
            # choosing before any is sent. A choice that ends elsewhere is forgotten at the next report.
            self._count_placed(ranked[0][0].replica_id, pending_request)
        return ranked

    def _count_placed(self, replica_id: ReplicaID, request: PendingRequest | None) -> None:
        if request is None:
            self._seen(replica_id).unnamed += 1
            return
        request_id = request.metadata.internal_request_id
        before = self._placed_on.get(request_id)
        if before is not None and before != replica_id and before in self._since_report:
            self._since_report[before].placed.discard(request_id)  # Serve routes it again: it left there
        self._placed_on[request_id] = replica_id
        self._seen(replica_id).placed.add(request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Serve's hook, run on the router's event loop once per request sent to a replica, when it ends
        (a WebSocket session when it closes; a request the replica refused, too): a request placed since the
        replica's current report no longer counts against it."""
        placed_on = self._placed_on.pop(internal_request_id, None)
        if placed_on is not None and placed_on in self.curr_replicas:
            self._seen(placed_on).placed.discard(internal_request_id)
