"""The engine core in a process of its own, and the supervisor that keeps one running.

Following vLLM v1's shape: one process owns the device and runs the step loop; API workers (the
WebSocket/HTTP server), Pipecat pipelines or benchmarks in other processes talk to it through
`EngineClient` (`engine/process/client.py`) with typed request messages. The step loop therefore never shares an
interpreter lock with JSON, sockets, PCM encoding or resampling. What runs inside the process is
`engine/process/core_server.py`; this module is the supervisor's side (`EngineProcess`), which imports no torch, so
`serve`'s supervisor process starts at once and holds no model memory. If the core's loop dies, the process
exits, and `EngineProcess` starts a fresh one after a back-off.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from .launch import STOP_SIGNAL, CoreLaunch, remove_socket_file

logger = logging.getLogger(__name__)


def run_core(launch: CoreLaunch, ready: Connection | None = None) -> None:
    """The engine-core process's entry point (`core_server.core_main`, imported only in that process)."""
    from ...caches import use_bytecode_cache

    use_bytecode_cache()  # before torch's import: see caches.py
    from .core_server import core_main

    core_main(launch, ready)


class EngineProcess:
    """Starts an engine-core process and keeps one running: a process that dies is restarted after a
    back-off (doubling from `backoff_s[0]` up to `backoff_s[1]`, reset once a process has run a minute)."""

    def __init__(self, launch: CoreLaunch, *, restart: bool = True, backoff_s: tuple[float, float] = (1.0, 30.0)) -> None:
        self.launch = launch
        self.restart = restart
        self.backoff_s = backoff_s
        self.restarts = 0
        self._quick_deaths = 0  # deaths in a row of processes that ran under a minute (sets the back-off)
        self._spawned_at = 0.0
        self.failure: str | None = None
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._stopping = threading.Event()
        # `stop` and a spawn take it in turn: a core spawned as `stop` runs would be left serving with no supervisor
        self._spawning = threading.Lock()
        self._watcher: threading.Thread | None = None

    @property
    def address(self) -> str:
        return self.launch.address

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self, timeout: float | None = None, *, wait: bool = True, on_failure: Any = None) -> None:
        """Start the process; with `wait`, until it serves (RuntimeError if it fails to start). Without,
        the start runs in the background and `on_failure(message)` is called if it fails."""
        if wait:
            self._spawn(timeout)
        self._watcher = threading.Thread(
            target=self._watch, args=(not wait, on_failure), name="qwen3tts-core-watch", daemon=True
        )
        self._watcher.start()

    def _spawn(self, timeout: float | None, *, restarting: bool = False) -> None:
        receiver, sender = self._context.Pipe(duplex=False)
        launch = replace(self.launch, process_restarts=self.restarts + restarting)
        process = self._context.Process(target=run_core, args=(launch, sender), name="qwen3tts-core", daemon=False)
        with self._spawning:
            if self._stopping.is_set():
                raise RuntimeError("the engine core was stopped")
            process.start()
            self._process = process
        sender.close()
        self._spawned_at = time.monotonic()
        if not receiver.poll(timeout):
            raise RuntimeError(f"the engine core did not start within {timeout} s")
        try:
            status, detail = receiver.recv()
        except EOFError:
            status, detail = "failed", f"exited with code {process.exitcode}"
        if status != "ready":
            self.failure = detail
            process.join(5)
            raise RuntimeError(f"the engine core failed to start: {detail}")

    def _watch(self, spawn_first: bool, on_failure: Any) -> None:
        if spawn_first:
            try:
                self._spawn(timeout=None)
            except RuntimeError as exc:
                logger.error("%s", exc)
                if on_failure is not None:
                    on_failure(str(exc))
                return
        while not self._stopping.is_set():
            process = self._process
            process.join()
            if self._stopping.is_set() or not self.restart:
                return
            self._quick_deaths = 0 if time.monotonic() - self._spawned_at > 60 else self._quick_deaths + 1
            wait = min(self.backoff_s[1], self.backoff_s[0] * 2 ** min(max(self._quick_deaths - 1, 0), 10))
            logger.error("the engine core exited with code %s; restarting in %.1f s", process.exitcode, wait)
            if self._stopping.wait(wait):
                return
            try:
                self._spawn(timeout=None, restarting=True)
                self.restarts += 1
            except RuntimeError:
                if not self._stopping.is_set():  # a core stopped while it started fails to start: as asked
                    logger.exception("restarting the engine core failed")

    def kill(self) -> None:
        """Kill the process at once (fault injection: the supervisor restarts it)."""
        if self._process is not None:
            os.kill(self._process.pid, signal.SIGKILL)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the core: asked first with `STOP_SIGNAL` (it ends its streams and closes; the signals a terminal
        or systemd send the whole process group wait for this, `core_server._stop_on_signals`), SIGKILLed if it
        is still there after `timeout` seconds. Its socket file (`remove_socket_file`) goes first, so that a stop cut
        short leaves none (a Ray replica's graceful-shutdown timeout kills the core with its worker), and again at
        the end, in case a core still starting bound it meanwhile; clients connected already are not cut off."""
        with self._spawning:
            self._stopping.set()
            process = self._process
        remove_socket_file(self.address)
        if process is not None and process.is_alive():
            with contextlib.suppress(ProcessLookupError):  # it died meanwhile
                os.kill(process.pid, STOP_SIGNAL)
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()
        remove_socket_file(self.address)
