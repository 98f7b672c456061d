"""What the API workers of one `serve --workers N` share: server-wide metrics and limits.

uvicorn runs each worker in a process of its own, so whatever a worker counts in memory is its share alone:
a scrape of `/metrics` would read the worker that took the connection, and `--max-sessions` would hold per
worker. The supervisor therefore makes a private temporary folder (`WorkerGroup.create`, removed when
`serve` ends) that every worker joins (`WorkerGroup.join`):

- `metrics/`: prometheus_client's multiprocess files (`PROMETHEUS_MULTIPROC_DIR`, set before the workers
  start): each worker's counters, histograms and gauges, which any worker's `/metrics` sums;
- `cells/<pid>`: per live worker, what it holds against the server-wide limits (`Held`: WebSocket sessions,
  utterances waiting for a synthesis slot);
- `lock`: taken (flock) around each check-and-increment of those counts, so N workers never admit past a
  limit between them.

A worker holds a shared flock on its own cell for as long as it lives. The kernel drops that lock however the
process ends, SIGKILL included, so a cell that nobody holds belongs to a dead worker: whoever sums the cells
next deletes it (its sessions and queued utterances stop counting) and marks its process dead for
prometheus_client (its live gauges drop out; its counters and histograms stay in the totals, as Prometheus
expects of counters). No pid is trusted as a sign of life, so a reused pid cannot keep a dead worker counted.

POSIX only (flock), as is the engine core's ZeroMQ ipc socket that `serve --workers N` needs anyway.
"""

from __future__ import annotations

import enum
import fcntl
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from prometheus_client.multiprocess import mark_process_dead

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is first imported


class Held(enum.IntEnum):
    """What a worker holds against a server-wide limit: one field of its cell each."""

    SESSIONS = 0  # WebSocket sessions open (`--max-sessions`)
    QUEUED = 1  # utterances waiting for a synthesis slot (`--max-queued`)


_CELL = struct.Struct(f"<{len(Held)}q")


class Count(Protocol):
    """A number of things held against a limit: `try_add` checks and counts in one step."""

    @property
    def total(self) -> int: ...

    def try_add(self, limit: int | None) -> bool:
        """Count one more unless `limit` is given and the total is at it already; True if counted."""
        ...

    def remove(self) -> None:
        """One fewer (one that `try_add` counted)."""
        ...


class LocalCount:
    """A count of this process alone: a server of one process (one API worker, tests, Ray replicas)."""

    def __init__(self) -> None:
        self._value = 0

    @property
    def total(self) -> int:
        return self._value

    def try_add(self, limit: int | None) -> bool:
        if limit is not None and self._value >= limit:
            return False
        self._value += 1
        return True

    def remove(self) -> None:
        self._value -= 1


class WorkerGroup:
    """The folder the supervisor makes for its `size` API workers (see the module's docstring)."""

    def __init__(self, directory: Path, size: int) -> None:
        self.directory = directory
        self.size = size

    @classmethod
    def create(cls, size: int) -> WorkerGroup:
        """A fresh private folder (mode 0700) under the system's temporary directory."""
        group = cls(Path(tempfile.mkdtemp(prefix="qwen3tts-workers-")), size)
        group.metrics_dir.mkdir()
        group.cells_dir.mkdir()
        group.lock_file.touch(0o600)
        return group

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def metrics_dir(self) -> Path:
        return self.directory / "metrics"

    @property
    def cells_dir(self) -> Path:
        return self.directory / "cells"

    @property
    def lock_file(self) -> Path:
        return self.directory / "lock"

    def join(self) -> WorkerCell:
        """This process's membership, for its life. Call before any metric is made: a process that reuses a
        dead worker's pid must not inherit that worker's live gauges."""
        if os.environ.get(METRICS_DIR_ENV) != str(self.metrics_dir):
            raise RuntimeError(f"{METRICS_DIR_ENV} must be {self.metrics_dir} before prometheus_client is imported")
        return WorkerCell(self)


class WorkerCell:
    """One worker's cell in its group: its own counts, and the totals over every live worker."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.pid = os.getpid()
        self._values = [0] * len(Held)
        self._thread_lock = threading.Lock()  # flock is per open file: it does not keep this process's threads apart
        self._lock_fd = os.open(group.lock_file, os.O_RDWR)
        with self._locked():
            mark_process_dead(self.pid, str(group.metrics_dir))  # a dead worker's, should this pid be reused
            pending = group.cells_dir / f".{self.pid}.new"
            self._fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.pwrite(self._fd, _CELL.pack(*self._values), 0)
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # held until this process ends, however it ends
            os.replace(pending, group.cells_dir / str(self.pid))  # whole and locked, or not there at all

    def count(self, held: Held) -> SharedCount:
        return SharedCount(self, held)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The group's lock: held for a few small reads (tens of µs), so taking it on the event loop is fine."""
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def totals(self) -> tuple[int, ...]:
        """Each field of `Held` summed over the live workers (dropping any dead worker found)."""
        with self._locked():
            return self._totals()

    def try_add(self, held: Held, limit: int | None) -> bool:
        with self._locked():
            if limit is not None and self._totals()[held] >= limit:
                return False
            self._set(held, self._values[held] + 1)
        return True

    def remove(self, held: Held) -> None:
        with self._locked():
            self._set(held, self._values[held] - 1)

    def _set(self, held: Held, value: int) -> None:
        self._values[held] = value
        os.pwrite(self._fd, _CELL.pack(*self._values), 0)

    def _totals(self) -> tuple[int, ...]:
        sums = [0] * len(Held)
        for values in self._live_cells():
            for field, value in enumerate(values):
                sums[field] += value
        return tuple(sums)

    def _live_cells(self) -> Iterator[tuple[int, ...]]:
        """The values of every live worker's cell; a cell nobody holds is a dead worker's, removed here.
        Only under the group's lock, so a new cell cannot take a reaped one's name in between."""
        with os.scandir(self.group.cells_dir) as listing:
            entries = list(listing)
        for entry in entries:
            if not entry.name.isdigit():
                continue  # a cell being made
            pid = int(entry.name)
            if pid == self.pid:
                yield tuple(self._values)
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its worker holds it: alive
                    yield _CELL.unpack(os.pread(fd, _CELL.size, 0))
                    continue
                os.unlink(entry.path)
                mark_process_dead(pid, str(self.group.metrics_dir))
            finally:
                os.close(fd)


class SharedCount:
    """This worker's part of a count over every live worker of its group."""

    def __init__(self, cell: WorkerCell, held: Held) -> None:
        self._cell = cell
        self._held = held

    @property
    def total(self) -> int:
        return self._cell.totals()[self._held]

    def try_add(self, limit: int | None) -> bool:
        return self._cell.try_add(self._held, limit)

    def remove(self) -> None:
        self._cell.remove(self._held)
