"""`serve --workers N`'s shared counts (server/workers.py) between real processes, without a server."""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.multiprocess import MultiProcessCollector

from qwen3tts_agent.server.workers import METRICS_DIR_ENV, Held, WorkerGroup

MEMBERS = 4
CHURN_LIMIT = 2  # below the members: they contend for it all the time
CHURN_ROUNDS = 1000
LIMIT = 50


def _member(directory: str, conn: Connection) -> None:
    """A worker: joins; on "go", with the others, takes and gives back a session many times, counting the
    times the total it then reads is past the limit; on "fill" (once every worker is done with that: a worker
    filling up while another still churns would read the filler's sessions as the churner's excess), takes as
    many sessions as it can and holds them until told to leave or killed. Its live gauge counts those, as `qwen3tts_active_streams` would."""
    cell = WorkerGroup(Path(directory), MEMBERS).join()
    held = Gauge("held", "sessions this worker admitted", registry=CollectorRegistry(), multiprocess_mode="livesum")
    conn.send("joined")
    conn.recv()
    over = 0
    for _ in range(CHURN_ROUNDS):
        if cell.try_add(Held.SESSIONS, CHURN_LIMIT):
            over += cell.totals()[Held.SESSIONS] > CHURN_LIMIT
            cell.remove(Held.SESSIONS)
    conn.send(over)
    conn.recv()
    admitted = sum(cell.try_add(Held.SESSIONS, LIMIT) for _ in range(2 * LIMIT))
    held.inc(admitted)
    conn.send(admitted)
    conn.recv()


def _held_gauge(group: WorkerGroup) -> float:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(group.metrics_dir))
    return registry.get_sample_value("held") or 0.0


def test_workers_never_admit_past_a_shared_limit_and_a_killed_ones_share_drops_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = WorkerGroup.create(MEMBERS)
    monkeypatch.setenv(METRICS_DIR_ENV, str(group.metrics_dir))  # as the supervisor does, before the workers start
    context = multiprocessing.get_context("spawn")
    members = []
    try:
        for _ in range(MEMBERS):
            ours, theirs = context.Pipe()
            process = context.Process(target=_member, args=(str(group.directory), theirs), daemon=True)
            process.start()
            members.append((process, ours))
        for _, conn in members:
            assert conn.poll(60) and conn.recv() == "joined"
        for _, conn in members:  # all at once: each check-and-add races the others'
            conn.send("go")
        assert [conn.recv() for _, conn in members if conn.poll(60)] == [0] * MEMBERS  # never past the limit
        for _, conn in members:  # all at once again: each fills up as the others do
            conn.send("fill")
        admitted = {process.pid: conn.recv() for process, conn in members if conn.poll(60)}
        assert sum(admitted.values()) == LIMIT, admitted
        observer = group.join()  # this process, as a worker that admitted nothing
        assert observer.totals()[Held.SESSIONS] == LIMIT
        assert _held_gauge(group) == LIMIT

        doomed, _ = max(members, key=lambda member: admitted[member[0].pid])
        assert doomed.pid is not None
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join(10)
        assert observer.totals()[Held.SESSIONS] == LIMIT - admitted[doomed.pid]  # found dead, dropped
        assert not (group.directory / "cells" / str(doomed.pid)).exists()
        assert _held_gauge(group) == LIMIT - admitted[doomed.pid]  # its live gauge went with it

        for process, conn in members:
            if process is not doomed:
                conn.send("leave")
                process.join(10)
        assert observer.totals()[Held.SESSIONS] == 0
        assert observer.try_add(Held.SESSIONS, 1) and not observer.try_add(Held.SESSIONS, 1)
        observer.remove(Held.SESSIONS)
        assert observer.totals() == (0, 0)
    finally:
        for process, _ in members:
            process.kill()
            process.join(10)
        group.remove()
    assert not group.directory.exists()
