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
  limit between them;
- `alive`: share-locked (flock) by the supervisor and by every worker for as long as each lives. The supervisor
  removes the folder when `serve` ends; one killed outright (SIGKILL, the OOM killer) cannot, so the next `serve`
  removes every group folder of over `STALE_GROUP_AGE_S` whose `alive` nobody holds (`remove_stale_groups`).

A worker holds a shared flock on its own cell for as long as it lives. The kernel drops that lock however the
process ends, SIGKILL included, so a cell that nobody holds belongs to a dead worker: whoever sums the cells
next deletes it (its sessions and queued utterances stop counting) and marks its process dead for
prometheus_client (its live gauges drop out; its counters and histograms stay in the totals, as Prometheus
expects of counters). No pid is trusted as a sign of life, so a reused pid cannot keep a dead worker counted.

POSIX only (flock), as is the engine core's ZeroMQ ipc socket that `serve --workers N` needs anyway.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from prometheus_client.multiprocess import mark_process_dead

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is first imported
GROUP_PREFIX = "qwen3tts-workers-"
ALIVE_FILE = "alive"
# A group folder nobody holds is removed by the next `serve` once it is this old (younger: it may be being made).
STALE_GROUP_AGE_S = 60.0


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
        self._alive_fd: int | None = None  # the supervisor's hold on `alive` (`create`)

    @classmethod
    def create(cls, size: int, parent: Path | None = None) -> WorkerGroup:
        """A fresh private folder (mode 0700) under `parent` (default: the system's temporary directory), held
        alive by this process until `remove`; first the folders there of groups whose processes have all gone."""
        parent = parent or Path(tempfile.gettempdir())
        remove_stale_groups(parent)
        group = cls(Path(tempfile.mkdtemp(prefix=GROUP_PREFIX, dir=parent)), size)
        group.metrics_dir.mkdir()
        group.cells_dir.mkdir()
        group.lock_file.touch(0o600)
        group._alive_fd = _hold_alive(group.alive_file)
        return group

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._alive_fd is not None:
            os.close(self._alive_fd)
            self._alive_fd = None

    @property
    def metrics_dir(self) -> Path:
        return self.directory / "metrics"

    @property
    def cells_dir(self) -> Path:
        return self.directory / "cells"

    @property
    def lock_file(self) -> Path:
        return self.directory / "lock"

    @property
    def alive_file(self) -> Path:
        return self.directory / ALIVE_FILE

    def join(self) -> WorkerCell:
        """This process's membership, for its life. Call before any metric is made: a process that reuses a
        dead worker's pid must not inherit that worker's live gauges."""
        if os.environ.get(METRICS_DIR_ENV) != str(self.metrics_dir):
            raise RuntimeError(f"{METRICS_DIR_ENV} must be {self.metrics_dir} before prometheus_client is imported")
        return WorkerCell(self)


def _hold_alive(path: Path) -> int:
    """Open (or make) a group's `alive` file and share-lock it: the lock lasts as long as the file stays open or
    its process lives, however the process ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def remove_stale_groups(parent: Path) -> list[Path]:
    """Remove the group folders in `parent` that no process holds alive any more (left by a supervisor killed
    outright, its workers gone too), over STALE_GROUP_AGE_S old; return them. A folder without an `alive` file
    (half made, or not made by this package) is left alone."""
    removed = []
    for path in parent.glob(f"{GROUP_PREFIX}*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to open
            if time.time() - path.lstat().st_mtime < STALE_GROUP_AGE_S:
                continue
            fd = os.open(path / ALIVE_FILE, os.O_RDONLY)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a supervisor or a worker holds it: alive
                    continue
                shutil.rmtree(path)
                removed.append(path)
            finally:
                os.close(fd)
    return removed


class WorkerCell:
    """One worker's cell in its group: its own counts, and the totals over every live worker."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.pid = os.getpid()
        self._values = [0] * len(Held)
        self._thread_lock = threading.Lock()  # flock is per open file: it does not keep this process's threads apart
        self._lock_fd = os.open(group.lock_file, os.O_RDWR)
        self._alive_fd = _hold_alive(group.alive_file)  # for as long as this process lives
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
