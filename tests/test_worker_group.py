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

from qwen3tts_agent.server.workers import (
    METRICS_DIR_ENV,
    STALE_GROUP_AGE_S,
    Held,
    WorkerGroup,
    remove_stale_groups,
)

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


def _supervisor(parent: str, conn: Connection) -> None:
    """A supervisor that makes its group and waits to be killed (it never removes the folder)."""
    conn.send(str(WorkerGroup.create(2, parent=Path(parent)).directory))
    conn.recv()


def _worker(directory: str, conn: Connection) -> None:
    """A worker of that group that outlives its supervisor."""
    WorkerGroup(Path(directory), 2).join()
    conn.send("joined")
    conn.recv()


def test_a_killed_supervisors_group_folder_is_removed_once_no_process_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve` removes its group folder as it ends; killed outright it cannot, and the next one removes the
    folders that neither a supervisor nor a worker holds any more, if old enough to be more than being made."""
    context = multiprocessing.get_context("spawn")
    processes: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []

    def spawn(target: object, arg: str) -> tuple[multiprocessing.process.BaseProcess, Connection]:
        ours, theirs = context.Pipe()
        process = context.Process(target=target, args=(arg, theirs), daemon=True)
        process.start()
        processes.append((process, ours))  # kept open: a closed end would let the process return
        return process, ours

    def kill(process: multiprocessing.process.BaseProcess) -> None:
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)

    try:
        dead_supervisor, conn = spawn(_supervisor, str(tmp_path))
        assert conn.poll(60)
        dead = Path(conn.recv())
        orphaned_supervisor, conn = spawn(_supervisor, str(tmp_path))
        assert conn.poll(60)
        orphaned = Path(conn.recv())
        monkeypatch.setenv(METRICS_DIR_ENV, str(orphaned / "metrics"))
        worker, conn = spawn(_worker, str(orphaned))
        assert conn.poll(60) and conn.recv() == "joined"
        kill(dead_supervisor)
        kill(orphaned_supervisor)  # its worker lives on
        live = WorkerGroup.create(2, parent=tmp_path)  # this process's, held
        young_dead = tmp_path / "qwen3tts-workers-young"
        young_dead.mkdir()
        (young_dead / "alive").touch()
        foreign = tmp_path / "qwen3tts-workers-foreign"  # no `alive`: not a group this package made
        foreign.mkdir()
        old = os.stat(dead).st_mtime - STALE_GROUP_AGE_S - 1
        for folder in (dead, orphaned, live.directory, foreign):
            os.utime(folder, (old, old))

        assert remove_stale_groups(tmp_path) == [dead]
        assert not dead.exists() and orphaned.exists() and live.directory.exists()
        assert young_dead.exists() and foreign.exists()
        kill(worker)  # the orphaned group's last process
        os.utime(orphaned, (old, old))
        assert remove_stale_groups(tmp_path) == [orphaned]
        live.remove()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen3tts-workers-foreign", "qwen3tts-workers-young"]
    finally:
        for process, _ in processes:
            process.kill()
            process.join(10)
