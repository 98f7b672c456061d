"""`serve` with the engine core in a process of its own: the supervisor, and the API workers' app.

The supervisor (the process `qwen3tts-agent serve` starts in) launches the engine-core process
(`engine/process/supervisor.py`, restarted with a back-off if it dies) and runs uvicorn: one API worker in this
process, or `--workers N` worker processes on one listening socket (uvicorn's own supervisor restarts a
worker that dies). Every worker builds its app with `worker_app()`, whose engine is an `EngineClient` of
the core, so HTTP/WebSocket handling, JSON and PCM encoding never share an interpreter with the step loop.
Several workers share a private folder (`server/workers.py`) for server-wide metrics and limits.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from ..engine.process import GIL_SWITCH_INTERVAL_S, CoreLaunch, EngineProcess, fresh_core_address
from .config import ServerConfig

logger = logging.getLogger(__name__)

SETTINGS_ENV = "QWEN3TTS_SERVE_SETTINGS"  # how the supervisor hands the settings to its API workers
# An API worker takes connections once it is ready, or after this long (then answering 503 until it is): a
# port shared by several workers hands no client to one still connecting to the core (ServerState.lifespan).
WORKER_READY_WAIT_S = 60.0


def default_core_address() -> str:
    return fresh_core_address("qwen3tts-core")


def _config_to_json(config: ServerConfig) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}


def _config_from_json(data: dict[str, Any]) -> ServerConfig:
    paths = {f.name for f in fields(ServerConfig) if "Path" in str(f.type)}
    values: dict[str, Any] = {k: Path(v) if k in paths and v is not None else v for k, v in data.items()}
    return ServerConfig(**values)


def _core_failure_file() -> Path:
    """Where the supervisor writes why the engine core failed to start, for its API workers to read."""
    return Path(tempfile.gettempdir()) / f"qwen3tts-core-{os.getpid()}.failed"


def connect_to_core(address: str, failure_file: Path) -> Any:
    """An `EngineClient` of the core once it serves (one connection, so every worker connects the moment the
    core binds); EngineNotReadyError as soon as its start failed (the supervisor wrote `failure_file`), so a
    worker stops waiting and `serve` exits instead of hanging."""
    from ..engine.process import EngineClient

    def failed() -> str | None:
        return failure_file.read_text() if failure_file.exists() else None

    return EngineClient.connect(address, timeout=None, give_up=failed)


def show_server_logs(log_level: str) -> None:
    """The server's own log lines (its readiness and effective limits) at `--log-level`, as the core's are:
    the CLI's root logger shows warnings only, and a worker that uvicorn spawns has no logging set up."""
    logging.basicConfig(format="%(asctime)s %(levelname)s [api %(process)d] %(name)s: %(message)s")
    logging.getLogger("qwen3tts_agent").setLevel(log_level.upper())


def worker_app() -> Any:
    """The app of one API worker (a uvicorn factory): the server over an `EngineClient` of the core."""
    settings = json.loads(os.environ[SETTINGS_ENV])
    show_server_logs(settings["log_level"])
    from ..caches import use_bytecode_cache

    use_bytecode_cache()
    from .app import create_app

    # the event loop and the engine client's I/O thread share the interpreter lock: hand it over quickly
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    config = _config_from_json(settings["config"])
    address, failure_file = settings["core_address"], Path(settings["core_failure_file"])
    worker = None
    if settings["worker_group"] is not None:  # one of several workers
        from .workers import WorkerGroup

        worker = WorkerGroup(Path(settings["worker_group"]), settings["workers"]).join()
    return create_app(
        config, engine_factory=lambda: connect_to_core(address, failure_file), ready_wait_s=WORKER_READY_WAIT_S,
        worker=worker,
    )


class _CoreFailure:
    """A failed start of the engine core, told to the API workers (a file they watch, `connect_to_core`) and to
    uvicorn (its exit flag). The core starts first, so it may fail before uvicorn is set up to be told."""

    def __init__(self, failure_file: Path) -> None:
        self.failure_file = failure_file
        self.messages: list[str] = []
        self._stop: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def report(self, message: str) -> None:
        with self._lock:
            self.messages.append(message)
            written = self.failure_file.with_suffix(".writing")
            written.write_text(message)
            written.replace(self.failure_file)  # whole, at once: the workers stop waiting for the core
            if self._stop is not None:
                self._stop()

    def stop_with(self, stop: Callable[[], None]) -> bool:
        """Call `stop` should the core fail from now on; False (and no call) if it has failed already."""
        with self._lock:
            if self.messages:
                return False
            self._stop = stop
            return True


def serve(config: ServerConfig, launch: CoreLaunch, *, workers: int, log_level: str) -> int:
    """Run the engine core and the API workers until interrupted; 1 if the core failed to start.

    The core is started first: its imports, weights and warm-up (the whole of the time to ready) then run
    while this process loads the web stack and starts the workers."""
    failure = _CoreFailure(_core_failure_file())
    failure.failure_file.unlink(missing_ok=True)
    core = EngineProcess(launch)
    core.start(wait=False, on_failure=failure.report)
    try:
        _run_api_workers(config, launch.address, workers, log_level, failure)
        return 1 if failure.messages else 0
    finally:
        core.stop()
        failure.failure_file.unlink(missing_ok=True)


def _run_api_workers(config: ServerConfig, core_address: str, workers: int, log_level: str, failure: _CoreFailure) -> None:
    """uvicorn with `workers` API workers (in this process when one) until interrupted or the core fails.

    Several workers get a fresh `WorkerGroup` folder, made before they start (prometheus_client reads
    `PROMETHEUS_MULTIPROC_DIR` once, when a worker first imports it) and removed once they have all stopped."""
    from .workers import METRICS_DIR_ENV, WorkerGroup

    group = WorkerGroup.create(workers) if workers > 1 else None
    outer_metrics_dir = os.environ.get(METRICS_DIR_ENV)
    try:
        if group is not None:
            os.environ[METRICS_DIR_ENV] = str(group.metrics_dir)  # inherited by the workers uvicorn spawns
        os.environ[SETTINGS_ENV] = json.dumps({
            "config": _config_to_json(config), "core_address": core_address,
            "core_failure_file": str(failure.failure_file),
            "worker_group": str(group.directory) if group is not None else None, "workers": workers,
            "log_level": log_level,
        })
        _run_uvicorn(config, workers, log_level, failure)
    finally:
        if group is not None:
            if outer_metrics_dir is None:
                os.environ.pop(METRICS_DIR_ENV, None)
            else:
                os.environ[METRICS_DIR_ENV] = outer_metrics_dir
            group.remove()


def _run_uvicorn(config: ServerConfig, workers: int, log_level: str, failure: _CoreFailure) -> None:
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from .connections import uvicorn_options

    options: dict[str, Any] = {**uvicorn_options(config, log_level=log_level), "factory": True, "workers": workers}
    server_config = uvicorn.Config("qwen3tts_agent.server.launcher:worker_app", **options)
    server = uvicorn.Server(server_config)
    supervisor = Multiprocess(server_config, sockets=[server_config.bind_socket()]) if workers > 1 else None

    def stop() -> None:
        # uvicorn's own exit flags, not a signal: a SIGTERM that uvicorn re-raises after its shutdown would
        # kill this process before it stops the core and returns 1
        if supervisor is not None:
            supervisor.should_exit.set()
        else:
            server.should_exit = True

    def stop_on_signal(sig: int, _frame: Any) -> None:
        # uvicorn (one worker) restores this handler after its graceful shutdown and re-raises the signal into
        # it: the default one would end this process there, leaving the core running without its supervisor
        server.should_exit = True

    if not failure.stop_with(stop):
        return
    if supervisor is not None:
        supervisor.run()  # restarts dead workers; takes SIGINT/SIGTERM itself and returns
    else:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop_on_signal)
        server.run()
