"""`EngineClient`: the engine's public API in a process that does not own the device.

It has the same API as `Engine` (open_stream, streams, create_voice, stats, languages, speakers, ...),
validates and tokenizes here like `Engine`, and talks to an engine-core process (`engine/process/supervisor.py`)
over ZeroMQ. One I/O thread owns the socket: requests from any thread reach it through thread-local
in-process sockets, and outputs it receives are handed to their streams.

The core's stats arrive every 250 ms and double as a heartbeat: if the core is silent for
`dead_after_s`, its streams end with `EngineDeadError` and new ones are refused with
`EngineNotReadyError` until a core (the restarted one) answers the client's hello again.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

from ...errors import EngineClosedError, EngineDeadError, EngineNotReadyError, EngineOverloadedError
from ..frontend import (
    AudioInput,
    EngineFrontend,
    EngineStats,
    TextTokenizer,
    error_from_info,
    prepare_reference,
)
from ..messages import CoreRequest, ErrorInfo
from ..types import VoicePrompt
from . import ipc

logger = logging.getLogger(__name__)

HELLO_INTERVAL_S = 0.5
# How often the socket tries to reach a core that is not there (ZeroMQ's default: 100 ms). The hellos said
# meanwhile wait in its queue and arrive as it connects, so this is how far apart the clients of one restarted
# core (a server's API workers) hear of it: one that is ready while another still refuses as not ready.
RECONNECT_INTERVAL_MS = 10
PING_INTERVAL_S = 0.5
GIVE_UP_POLL_S = 0.5  # how often a waiting `connect` asks its `give_up`


class CoreLink:
    """An engine client's link to the core: its socket and the I/O thread that says hello until a core welcomes it,
    pings it, and notices when it goes silent or away."""

    def __init__(self, address: str, on_message: Any, dead_after_s: float) -> None:
        self.address = address
        self.identity = uuid.uuid4().bytes[:8]
        self._on_message = on_message
        self._dead_after_s = dead_after_s
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._in_address = f"inproc://qwen3tts-client-{self.identity.hex()}"
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._sockets_lock = threading.Lock()
        self._stopping = threading.Event()
        self._bound = threading.Event()
        self.connected = False  # a core has welcomed us and not gone silent since
        self.last_heard = 0.0
        self._thread = threading.Thread(target=self._run, name="qwen3tts-client-io", daemon=True)
        self._thread.start()
        self._bound.wait()

    def send(self, frames: list[bytes]) -> None:
        """Queue a message for the core (any thread)."""
        socket = getattr(self._local, "socket", None)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self._in_address)
            self._local.socket = socket
            with self._sockets_lock:
                self._sockets.append(socket)
        socket.send_multipart(frames, copy=False)

    def close(self) -> None:
        self.send([ipc.BYE])
        time.sleep(0.05)
        self._stopping.set()
        self._thread.join(timeout=5)
        with self._sockets_lock:
            for socket in self._sockets:
                socket.close(linger=0)

    def _run(self) -> None:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.identity)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)
        dealer.connect(self.address)
        # a core process that dies closes its end at once: its disconnect is noticed before its heartbeat lapses
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        pull = self._context.socket(zmq.PULL)
        pull.bind(self._in_address)
        self._bound.set()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        next_hello = next_ping = 0.0
        while not self._stopping.is_set():
            events = dict(poller.poll(timeout=100))
            if pull in events:
                while True:
                    try:
                        dealer.send_multipart(pull.recv_multipart(zmq.NOBLOCK), copy=False)
                    except zmq.Again:
                        break
            if dealer in events:
                while True:
                    try:
                        frames = dealer.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.last_heard = time.monotonic()
                    try:
                        self._on_message(frames)
                    except Exception:  # noqa: BLE001 - one bad message must not stop the link
                        logger.exception("bad message from the engine core")
            if monitor in events:
                while True:
                    try:
                        monitor.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self.connected:
                        self.connected = False
                        self._on_message([b"lost"])
            now = time.monotonic()
            if self.connected and now - self.last_heard > self._dead_after_s:
                self.connected = False
                self._on_message([b"lost"])
            if not self.connected and now >= next_hello:
                dealer.send_multipart([ipc.HELLO])
                next_hello = now + HELLO_INTERVAL_S
            if self.connected and now >= next_ping:
                dealer.send_multipart([ipc.PING])
                next_ping = now + PING_INTERVAL_S
        dealer.disable_monitor()
        monitor.close()
        dealer.close()
        pull.close()


class EngineClient(EngineFrontend):
    """The engine's API over an engine-core process. Create with `EngineClient.connect(address)`."""

    def __init__(self, link: CoreLink, welcome: dict[str, Any]) -> None:
        super().__init__(
            welcome["info"], TextTokenizer(welcome["tokenizer"]),
            max_queue=welcome["max_queue"], max_text_chars=welcome["max_text_chars"],
        )
        self._link = link
        self._instance = welcome["instance"]
        self._stats: EngineStats | None = None
        self._calls = itertools.count(1)
        self._pending_calls: dict[int, Future[Any]] = {}
        self.device = self.info.device

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        timeout: float | None = 600.0,
        dead_after_s: float = 3.0,
        give_up: Callable[[], str | None] | None = None,
    ) -> EngineClient:
        """Connect to an engine-core process, waiting (up to `timeout`) for it to serve. Blocking.

        `give_up`, asked every `GIVE_UP_POLL_S` while waiting, returns a reason to stop waiting (raised as
        EngineNotReadyError), e.g. that the core failed to start; None to go on.
        """
        welcomed: Future[dict[str, Any]] = Future()
        client: list[EngineClient] = []

        def on_message(frames: list[bytes]) -> None:
            if client:
                client[0]._on_message(frames)
            elif frames[0] == ipc.WELCOME and not welcomed.done():
                link.connected = True
                welcomed.set_result(pickle.loads(frames[1]))

        link = CoreLink(address, on_message, dead_after_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if give_up is not None:
                wait = GIVE_UP_POLL_S if wait is None else min(GIVE_UP_POLL_S, wait)
            try:
                welcome = welcomed.result(wait)
                break
            except TimeoutError:
                reason = give_up() if give_up is not None else None
                if reason is not None or (deadline is not None and time.monotonic() >= deadline):
                    link.close()
                    raise EngineNotReadyError(
                        reason or f"no engine core answered at {address} within {timeout} s"
                    ) from None
        client.append(cls(link, welcome))
        return client[0]

    # ----------------------------------------------------------------- transport
    def _send(self, message: CoreRequest) -> None:
        self._link.send(ipc.encode_request(message))

    def _check_available(self) -> None:
        if self._closed:
            raise EngineClosedError("engine client is closed")
        if not self._accepting:
            raise EngineNotReadyError("the engine core is not reachable (starting or restarting); retry shortly")
        if self._stats is not None and self._stats.overloaded:
            reason = self._stats.refusal_reason
            raise EngineOverloadedError(f"busy: the engine is running behind real time ({reason}); retry shortly", reason)

    def _on_message(self, frames: list[bytes]) -> None:
        kind = frames[0]
        if kind == ipc.CHUNK:
            self.chunk(ipc.decode_chunk(frames[1], frames[2]))
        elif kind == ipc.FINISH:
            self.finish(ipc.decode_finish(frames[1]))
        elif kind == ipc.STATS:
            self._stats = EngineStats(**ipc.unpack(frames[1]))
        elif kind == ipc.VOICE_DONE:
            call_id, ok, payload = ipc.unpack(frames[1])
            future = self._pending_calls.pop(call_id, None)
            if future is not None:
                future.set_result(pickle.loads(payload)) if ok else future.set_exception(
                    error_from_info(ErrorInfo(*payload))
                )
        elif kind == ipc.WELCOME:
            welcome = pickle.loads(frames[1])
            if welcome["instance"] != self._instance:
                logger.warning("the engine core restarted; streams resume")
                self._instance = welcome["instance"]
            self._link.connected = True
            with self._lock:
                self._accepting = True
        elif kind == b"lost":
            logger.error("the engine core is gone (disconnected or silent); failing its streams")
            with self._lock:
                self._accepting = False
            self._fail_open_streams(EngineDeadError("the engine core stopped answering"))
            for future in list(self._pending_calls.values()):
                future.set_exception(EngineDeadError("the engine core stopped answering"))
            self._pending_calls.clear()

    # ----------------------------------------------------------------- the rest of the engine's API
    @property
    def healthy(self) -> bool:
        return self._accepting and not self._closed

    def stats(self) -> EngineStats:
        stats = self._stats or EngineStats(0, 0, self.max_streams, 0, 0, 0, 0, 0)
        stats.healthy = self.healthy
        return stats

    def create_voice(
        self, ref_audio: AudioInput, ref_text: str | None = None, *, x_vector_only: bool = False,
        max_ref_seconds: float | None = None,
    ) -> VoicePrompt:
        """Encode a reference voice in the core process (cached there by content). Blocking; thread-safe.
        `max_ref_seconds`: as for `Engine.create_voice` (the reference is cut here)."""
        if self._closed:
            raise EngineClosedError("engine client is closed")
        # refuse bad audio here, before it crosses processes
        wav, sr, ref_text = prepare_reference(ref_audio, ref_text, x_vector_only, max_ref_seconds)
        call_id = next(self._calls)
        future: Future[VoicePrompt] = Future()
        self._pending_calls[call_id] = future
        payload = [call_id, np.ascontiguousarray(wav, np.float32).tobytes(), sr, ref_text, x_vector_only]
        self._link.send([ipc.VOICE, ipc.pack(payload)])
        return future.result(timeout=300)


    def warmup(self, progress: bool = True) -> None:
        """Nothing to do: an engine-core process warms up before it serves."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_open_streams(EngineClosedError("engine client is closed"))
        self._link.close()
