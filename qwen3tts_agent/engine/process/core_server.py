"""Inside the engine-core process: the engine, and the server that bridges it to its clients.

An `Engine` runs as usual; a `CoreServer` bridges a ROUTER socket to its core: requests from clients go to
the core under ids prefixed by the client, and the core's outputs for those ids go back to that client. It
also publishes the engine's stats every 250 ms (the clients' heartbeat), and at once when the engine starts or
stops refusing new streams (the clients refuse from the last stats they got), encodes reference voices for
clients, and aborts the requests of a client that went silent. The supervisor's side is `engine/process/supervisor.py`.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import zmq

from ...errors import EngineDeadError
from ...models.compat import transformers_without_scikit_learn
from ..frontend import Engine
from ..messages import AbortRequest, AddRequest, ChunkOutput, FinishOutput
from . import ipc
from .launch import GIL_SWITCH_INTERVAL_S, STOP_SIGNAL, CoreLaunch, remove_socket_file

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25
# Between those, the I/O thread looks this often for a change of the engine's refusal of new streams (whether
# it refuses, and why) and publishes the stats at once when it changed: the clients (the API workers) refuse
# from the stats they have, and refusing or admitting up to a whole interval after the engine changed its mind
# lets a burst of arrivals in after the engine began to refuse, or refuses them for nothing after it stopped.
REFUSAL_CHECK_S = 0.02
# A client says hello every HELLO_INTERVAL_S until welcomed, and ZeroMQ queues those hellos while the core
# is still starting: they all arrive once it binds. One welcome (the tokenizer's megabytes) per client per
# this interval answers the burst; a client that lost the core and says hello again later is welcomed again.
WELCOME_INTERVAL_S = 0.25
CLIENT_SILENCE_S = 5.0  # a client not heard from for this long is gone: its requests are aborted
EXIT_CORE_DIED = 70
PARENT_POLL_S = 0.5  # how often the core checks that its supervisor is alive
ORPHAN_EXIT_S = 10.0  # an orphaned core that has not stopped cleanly this long after noticing exits outright
# A supervised core that got SIGTERM stops this long after it at the latest, if its supervisor has not stopped it
# (a signal to the whole process group: the supervisor stops the API workers first, then the core)
SIGNAL_GRACE_S = 30.0


class HostedEngine(Engine):
    """An `Engine` whose outputs for remote requests (ids `client:request`) go to a `CoreServer`."""

    server: CoreServer | None = None

    def chunk(self, output: ChunkOutput) -> None:
        if ":" in output.request_id and self.server is not None:
            self.server.send_chunk(output)
        else:
            super().chunk(output)

    def finish(self, output: FinishOutput) -> None:
        if ":" in output.request_id and self.server is not None:
            self.server.send_finish(output)
        else:
            super().finish(output)

    def _on_core_death(self, core: Any, exc: BaseException, lived_s: float) -> None:
        """In its own process a dead core means a dead process: the supervisor starts a fresh one."""
        self._fail_open_streams(_dead(exc))
        logger.error("engine core died (%s: %s); exiting for a restart", type(exc).__name__, exc)
        if self.server is not None:
            self.server.flush(timeout=1.0)
        os._exit(EXIT_CORE_DIED)


def _dead(exc: BaseException) -> EngineDeadError:
    return EngineDeadError(f"the engine core stopped: {type(exc).__name__}: {exc}")


class CoreServer:
    """Bridges a ROUTER socket to a hosted engine's core (see the module docstring)."""

    def __init__(self, engine: HostedEngine, address: str, *, process_restarts: int = 0) -> None:
        self.engine = engine
        self.address = address
        self.process_restarts = process_restarts  # core processes started before this one (`CoreLaunch`)
        self.instance = uuid.uuid4().hex
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._out_address = f"inproc://qwen3tts-core-out-{self.instance}"
        self._local = threading.local()
        self._owners: dict[str, bytes] = {}  # core request id -> client identity
        self._clients: dict[bytes, float] = {}  # identity -> last heard (monotonic)
        self._welcomed: dict[bytes, float] = {}  # identity -> last welcomed (monotonic; the I/O thread's)
        self._published_refusal: str | None = None  # `refusal_reason` in the stats last published (the I/O thread's)
        self._welcome = pickle.dumps(self._handshake())  # the same for every client of this core
        self._lock = threading.Lock()
        self._voices = ThreadPoolExecutor(1, thread_name_prefix="qwen3tts-voices")
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="qwen3tts-core-io", daemon=True)
        engine.server = self

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)

    def flush(self, timeout: float) -> None:
        """Give queued outputs a moment to leave (before the process exits)."""
        time.sleep(min(timeout, 0.2))

    # ----------------------------------------------------------------- outputs (the core's thread)
    def _push(self, frames: list[bytes | memoryview]) -> None:
        socket = getattr(self._local, "socket", None)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.connect(self._out_address)
            self._local.socket = socket
        socket.send_multipart(frames, copy=False)

    def send_chunk(self, output: ChunkOutput) -> None:
        identity = self._owners.get(output.request_id)
        if identity is not None:
            self._push([identity, *ipc.encode_chunk(output, output.request_id.split(":", 1)[1])])

    def send_finish(self, output: FinishOutput) -> None:
        with self._lock:
            identity = self._owners.pop(output.request_id, None)
        if identity is not None:
            self._push([identity, *ipc.encode_finish(output, output.request_id.split(":", 1)[1])])

    # ----------------------------------------------------------------- the I/O thread
    def _serve(self) -> None:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        router.bind(self.address)
        pull = self._context.socket(zmq.PULL)
        pull.bind(self._out_address)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        self._ready.set()
        next_stats = next_check = time.monotonic()
        while not self._stopping.is_set():
            events = dict(poller.poll(timeout=int(min(STATS_INTERVAL_S, REFUSAL_CHECK_S) * 1000)))
            if pull in events:
                while True:
                    try:
                        router.send_multipart(pull.recv_multipart(zmq.NOBLOCK), copy=False)
                    except zmq.Again:
                        break
            if router in events:
                while True:
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(router, frames)
                    except Exception:  # noqa: BLE001 - one client's malformed message must not stop the bridge
                        logger.exception("bad message from an engine client")
            now = time.monotonic()
            changed = False
            if now >= next_check:
                next_check = now + REFUSAL_CHECK_S
                changed = self.engine.refusal_reason() != self._published_refusal
            if now >= next_stats or changed:
                next_stats = now + STATS_INTERVAL_S
                self._publish_stats(router, now)
        router.close()
        pull.close()
        remove_socket_file(self.address)  # also when no supervisor stops this core (its parent died)

    def _handle(self, router: zmq.Socket, frames: list[bytes]) -> None:
        identity, kind, *rest = frames
        with self._lock:
            self._clients[identity] = time.monotonic()
        if kind == ipc.HELLO:
            now = time.monotonic()
            if now - self._welcomed.get(identity, -WELCOME_INTERVAL_S) >= WELCOME_INTERVAL_S:
                self._welcomed[identity] = now
                router.send_multipart([identity, ipc.WELCOME, self._welcome])
        elif kind in (ipc.ADD, ipc.TEXT, ipc.CLOSE, ipc.ABORT):
            message = ipc.decode_request(kind, rest[0])
            core_id = f"{identity.hex()}:{message.request_id}"
            if isinstance(message, AddRequest):
                with self._lock:
                    self._owners[core_id] = identity
            self.engine.core.submit(replace(message, request_id=core_id))
        elif kind == ipc.VOICE:
            self._voices.submit(self._create_voice, identity, rest[0])
        elif kind == ipc.BYE:
            self._forget(identity)

    def _handshake(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "instance": self.instance, "info": engine.info, "tokenizer": engine.tokenizer.to_json(),
            "max_queue": engine.max_queue, "max_text_chars": engine.max_text_chars,
        }

    def _create_voice(self, identity: bytes, payload: bytes) -> None:
        call_id, wav, sr, ref_text, x_vector_only = ipc.unpack(payload)
        try:
            prompt = self.engine.create_voice((np.frombuffer(wav, np.float32), sr), ref_text, x_vector_only=x_vector_only)
            reply = [call_id, True, pickle.dumps(prompt)]
        except Exception as exc:  # noqa: BLE001 - the client raises it
            reply = [call_id, False, [type(exc).__name__, str(exc)]]
        self._push([identity, ipc.VOICE_DONE, ipc.pack(reply)])

    def _publish_stats(self, router: zmq.Socket, now: float) -> None:
        stats = self.engine.stats()
        stats.restarts += self.process_restarts
        self._published_refusal = stats.refusal_reason
        encoded = ipc.encode_stats(stats)
        with self._lock:
            clients = list(self._clients.items())
        for identity, heard in clients:
            if now - heard > CLIENT_SILENCE_S:
                logger.warning("engine client %s went silent; aborting its requests", identity.hex())
                self._forget(identity)
            else:
                router.send_multipart([identity, ipc.STATS, encoded])

    def _forget(self, identity: bytes) -> None:
        self._welcomed.pop(identity, None)
        with self._lock:
            self._clients.pop(identity, None)
            mine = [rid for rid, owner in self._owners.items() if owner == identity]
        for rid in mine:
            self.engine.core.submit(AbortRequest(rid))


def _stop_with_parent(stop: threading.Event) -> None:
    """Stop once the process that started this one is gone. A supervisor killed outright (SIGKILL, an OOM
    kill) cannot stop its core, and an orphaned core would hold the device, its memory and its slots until
    someone found it. Exit outright if the clean stop takes long (the core may still be loading)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    logger.warning("the supervisor (pid %d) is gone: stopping", parent)
    stop.set()
    time.sleep(ORPHAN_EXIT_S)
    os._exit(0)


# transformers imports TensorFlow and JAX when they are installed (many ML images have them), at every start;
# the core uses neither. These are transformers' own switches, set only where the user has not set them.
FRAMEWORKS_OFF = {"USE_TF": "0", "USE_FLAX": "0"}


# From this many cores the CPU backend's graphs share one ONNX Runtime pool here (docs/cpu-backend.md): this
# process runs no other ONNX Runtime sessions, which that pool would refuse. Below it the frame steps have one
# thread, and a pool per graph lets them borrow the codec's idle cores. Unless the user chose otherwise.
SHARED_POOL_MIN_CORES = 4


def cpu_pool_default() -> dict[str, str]:
    """The engine-core process's default for QWEN3TTS_CPU_POOL, by PyTorch's thread count (the cores the
    engine splits between the frame steps and the codec, `audio.cpu_thread_split`)."""
    return {"QWEN3TTS_CPU_POOL": "shared" if torch.get_num_threads() >= SHARED_POOL_MIN_CORES else "session"}


def _stop_on_signals(stop: threading.Event) -> None:
    """How signals stop the core. The core shares its supervisor's process group, so Ctrl-C in a terminal and a stop
    by systemd (its default KillMode) signal the core together with the API workers. Stopping then would fail every
    stream the workers are still ending (each worker logging that the core is gone). So the core ignores SIGINT,
    stops on `STOP_SIGNAL` (its supervisor's `EngineProcess.stop`, once the workers have stopped), and on SIGTERM
    `SIGNAL_GRACE_S` later at the latest: a SIGTERM sent to the core alone still stops it (and its supervisor
    starts another). A signal rather than a shared event: a core killed while waiting on a multiprocessing event
    leaves it unusable, and the supervisor's next `set` would wait for that core for good."""

    def stop_later(*_: object) -> None:
        timer = threading.Timer(SIGNAL_GRACE_S, stop.set)
        timer.daemon = True  # a core stopped sooner exits without waiting for it
        timer.start()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop_later)
    signal.signal(STOP_SIGNAL, lambda *_: stop.set())


def core_main(launch: CoreLaunch, ready: Connection | None = None) -> None:
    """The engine-core process: load, warm up, serve until stopped (`_stop_on_signals`) or until the core dies."""
    for name, value in {**FRAMEWORKS_OFF, **cpu_pool_default()}.items():
        os.environ.setdefault(name, value)
    transformers_without_scikit_learn()  # after the switches above: transformers reads them at its import
    logging.basicConfig(level=launch.log_level.upper(), format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    stop = threading.Event()
    _stop_on_signals(stop)
    threading.Thread(target=_stop_with_parent, args=(stop,), name="qwen3tts-core-parent", daemon=True).start()
    try:
        started = time.perf_counter()
        engine = HostedEngine.load(
            launch.model, device=launch.device, dtype=launch.dtype, progress=False, **launch.engine_kwargs
        )
        assert isinstance(engine, HostedEngine)
        loaded = time.perf_counter()
        if launch.warmup:
            engine.warmup(progress=False)
        server = CoreServer(engine, launch.address, process_restarts=launch.process_restarts)
        server.start()
        logger.info("engine core started in %.1f s: imports and weights %.1f s, warm-up %.1f s",
                    time.perf_counter() - started, loaded - started, time.perf_counter() - loaded)
    except BaseException as exc:
        logger.exception("the engine core failed to start")
        if ready is not None:
            ready.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from exc
    if ready is not None:
        ready.send(("ready", launch.address))
    logger.info("engine core serving at %s", launch.address)
    stop.wait()
    server.stop()
    engine.close()
