"""The engine core in a process of its own, driven through `EngineClient`s in this and other processes."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from qwen3tts_agent import SamplingParams, TextLayout, Voice
from qwen3tts_agent.engine.messages import ChunkOutput
from qwen3tts_agent.engine.process import CoreLaunch, EngineClient, EngineProcess, core_server, ipc
from qwen3tts_agent.engine.process.core_server import CoreServer, HostedEngine, cpu_pool_default
from qwen3tts_agent.engine.process.launch import (
    STALE_SOCKET_AGE_S,
    fresh_core_address,
    remove_stale_socket_files,
)
from qwen3tts_agent.engine.types import ChunkTimings
from qwen3tts_agent.errors import (
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    InvalidReferenceAudioError,
    InvalidTextError,
)
from tests.engine_helpers import TEXT, engine_for, official_model, reference_audio
from tests.server_fixtures import wait_for

GREEDY = SamplingParams.greedy(max_frames=8)


@pytest.fixture(scope="module")
def core() -> EngineProcess:
    address = f"ipc://{os.environ.get('TMPDIR', '/tmp')}/qwen3tts-test-core-{os.getpid()}.sock"
    process = EngineProcess(
        CoreLaunch("synthetic:tiny", address, engine_kwargs={"max_streams": 4, "keep_codes": True, "backend": "torch"}, warmup=False),
        backoff_s=(0.2, 1.0),
    )
    process.start(timeout=180)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(core: EngineProcess) -> EngineClient:
    client = EngineClient.connect(core.address, timeout=60)
    yield client
    client.close()


def test_a_client_speaks_exactly_as_the_in_process_engine(client: EngineClient) -> None:
    local = engine_for("synthetic:tiny", max_streams=1)
    try:
        for engine in (local, client):
            assert engine.model_type == "base" and "english" in engine.languages
        voice_local = Voice(prompt=local.create_voice(reference_audio(), "This is my voice."))
        voice_remote = Voice(prompt=client.create_voice(reference_audio(), "This is my voice."))
        assert voice_local.prompt.voice_id == voice_remote.prompt.voice_id
        pcm_local, result_local = local.synthesize_blocking(TEXT, voice=voice_local, sampling=GREEDY)
        stream = client.open_stream(voice=voice_remote, sampling=GREEDY)
        for word in TEXT.split(" "):
            stream.push_text(word + " ")
        stream.close_input()
        pcm_remote = np.concatenate([c.pcm for c in stream.chunks(timeout=60)])
        assert stream.result.codes == result_local.codes and len(stream.result.codes) == 8
        np.testing.assert_allclose(pcm_remote, pcm_local, atol=1e-5)
        assert stream.result.finish_reason == "max_frames" and stream.result.first_audio_latency is not None
    finally:
        local.close()


def test_errors_cross_the_process_boundary_typed(client: EngineClient) -> None:
    with pytest.raises(InvalidReferenceAudioError):
        client.create_voice((np.zeros(24000, np.float32), 24000), None, x_vector_only=True)  # silent
    voice = Voice(prompt=client.create_voice(reference_audio(), None, x_vector_only=True))
    too_long = client.open_stream("1234567890" * 300, voice=voice, text_layout=TextLayout.PREFILL, sampling=GREEDY)
    with pytest.raises(InvalidTextError, match="positions"):  # the core refuses the prompt: typed, not generic
        list(too_long.chunks(timeout=60))
    time.sleep(0.6)
    assert client.stats().errors >= 1 and client.stats().healthy


def _doomed_client(address: str, started: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    client = EngineClient.connect(address, timeout=60)
    voice = Voice(prompt=client.create_voice(reference_audio(), None, x_vector_only=True))
    stream = client.open_stream(TEXT, voice=voice, sampling=SamplingParams(max_frames=2000, ignore_eos=True))
    next(stream.chunks(timeout=60))
    started.set()
    time.sleep(600)  # killed long before


def test_a_killed_client_loses_only_its_own_streams(core: EngineProcess, client: EngineClient) -> None:
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    doomed = context.Process(target=_doomed_client, args=(core.address, started))
    doomed.start()
    try:
        assert started.wait(120)
        voice = Voice(prompt=client.create_voice(reference_audio(), None, x_vector_only=True))
        mine = client.open_stream(TEXT, voice=voice, sampling=SamplingParams(max_frames=40, ignore_eos=True))
        first = next(mine.chunks(timeout=60))
        doomed.kill()
        rest = list(mine.chunks(timeout=60))
        assert first.frame_start == 0 and rest[-1].frame_end == 40
        deadline = time.monotonic() + 30  # the core notices the silent client and frees its slot
        while client.stats().active_streams and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.stats().active_streams == 0
    finally:
        doomed.kill()
        doomed.join()


def test_a_killed_core_ends_streams_at_once_and_comes_back(core: EngineProcess, client: EngineClient) -> None:
    voice = Voice(prompt=client.create_voice(reference_audio(), None, x_vector_only=True))
    stream = client.open_stream(TEXT, voice=voice, sampling=SamplingParams(max_frames=2000, ignore_eos=True))
    next(stream.chunks(timeout=60))
    core.kill()
    killed = time.monotonic()
    with pytest.raises(EngineDeadError):
        list(stream.chunks(timeout=30))
    assert time.monotonic() - killed < 2.0
    assert not client.healthy
    with pytest.raises(EngineNotReadyError):
        client.open_stream("Too soon.", voice=voice)
    deadline = time.monotonic() + 120
    while not client.healthy and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.healthy and core.restarts == 1
    while client.stats().restarts != 1 and time.monotonic() < deadline:  # the fresh core's first stats
        time.sleep(0.05)
    assert client.stats().restarts == 1  # it counts the process it replaced (/metrics shows it)
    voice = Voice(prompt=client.create_voice(reference_audio(), None, x_vector_only=True))  # a fresh core's cache
    pcm, result = client.synthesize_blocking("Back again.", voice=voice, sampling=SamplingParams(max_frames=3))
    assert result.frames == 3 and len(pcm) == 3 * 1920


def test_a_client_reaches_a_core_within_a_few_milliseconds_of_its_binding(tmp_path: Path) -> None:
    """A server's API workers are clients of one core: after a restart each must serve again about when the others
    do, or a session on a late one is told `not_ready` while /ready on another says 200. A client's hellos queue
    while no core is there and leave as its socket connects, which it tries every `RECONNECT_INTERVAL_MS`
    (ZeroMQ's default, 100 ms, let clients of one restarted core come back up to ~150 ms apart)."""
    from qwen3tts_agent.engine.process.client import CoreLink

    context = zmq.Context.instance()
    delays = []
    for attempt in range(8):  # ZeroMQ's 100 ms: each over 50 ms with a chance of one in two
        address = f"ipc://{tmp_path}/late-core-{attempt}.sock"
        link = CoreLink(address, on_message=lambda frames: None, dead_after_s=60.0)
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            time.sleep(0.25)  # no core yet: the link says hello to no one
            bound = time.monotonic()
            router.bind(address)
            assert router.poll(2000), "the link's hello never arrived"
            delays.append(time.monotonic() - bound)
            assert router.recv_multipart()[1] == ipc.HELLO
        finally:
            router.close()
            link.close()
    assert max(delays) < 0.05, delays


def test_a_stopped_supervisor_leaves_no_core_and_no_socket_file(tmp_path) -> None:
    """Over hours a server's supervisor restarts killed cores and is itself stopped and started again: each
    stop, at any moment of a restart, ends the core it started and takes its `ipc://` socket file with it."""
    socket_file = tmp_path / "core.sock"
    launch = CoreLaunch("synthetic:tiny", f"ipc://{socket_file}", engine_kwargs={"backend": "torch"}, warmup=False)
    for stop_after_kill_s in (0.0, 0.3, None):  # in the back-off, while the next core starts, once it serves
        supervisor = EngineProcess(launch, backoff_s=(0.2, 0.2))
        supervisor.start(timeout=180)
        first = supervisor.pid
        assert socket_file.exists()
        supervisor.kill()
        if stop_after_kill_s is None:
            wait_for(lambda s=supervisor: s.restarts == 1, 120, "the next core")
            assert supervisor.pid != first
        else:
            time.sleep(stop_after_kill_s)
        supervisor.stop(timeout=30)
        assert supervisor.pid is None or not _alive(supervisor.pid)
        assert not socket_file.exists()


def test_a_core_whose_supervisor_is_killed_stops_and_leaves_no_socket_file(tmp_path) -> None:
    """A supervisor killed outright (an OOM kill, a Ray worker torn down) cannot stop its core: the core notices,
    stops its streams and removes its own socket file."""
    socket_file = tmp_path / "core.sock"
    script = (
        "import sys, time\n"
        "from qwen3tts_agent.engine.process import CoreLaunch, EngineProcess\n"
        "if __name__ == '__main__':\n"
        f"    core = EngineProcess(CoreLaunch('synthetic:tiny', 'ipc://{socket_file}', warmup=False))\n"
        "    core.start(timeout=180)\n"
        "    print(core.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert supervisor.stdout is not None
        core_pid = int(supervisor.stdout.readline())
        assert socket_file.exists()
    finally:
        supervisor.kill()
        supervisor.wait()
    wait_for(lambda: not _alive(core_pid), 30, "the orphaned core to exit")
    assert not socket_file.exists()


def test_socket_files_left_by_killed_cores_go_and_live_or_young_ones_stay(tmp_path) -> None:
    """A supervisor killed with its core (an OOM kill of both, a Ray worker's children killed with it) leaves its
    socket file: the next core's start removes those no core listens on, by a connection refused, not by the pid
    in their names (another pid namespace sharing the folder may run that pid)."""
    old = time.time() - 2 * STALE_SOCKET_AGE_S

    def bound(name: str, *, listening: bool, age: float | None = old) -> tuple[Path, socket.socket]:
        path = tmp_path / name
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        if listening:
            server.listen()
        else:
            server.close()  # the file stays, as a killed core's does
        if age is not None:
            os.utime(path, (age, age))
        return path, server

    dead, _ = bound("qwen3tts-core-4242.sock", listening=False)
    dead_random, _ = bound(f"qwen3tts-core-{os.getpid()}-0123abcd.sock", listening=False)
    live, listener = bound("qwen3tts-core-1.sock", listening=True)
    young, _ = bound("qwen3tts-core-7.sock", listening=False, age=None)  # maybe a core between bind and listen
    other, _ = bound("something-else-1.sock", listening=False)
    try:
        removed = remove_stale_socket_files(tmp_path, "qwen3tts-core")
        assert sorted(removed) == sorted([dead, dead_random])
        assert not dead.exists() and not dead_random.exists()
        assert live.exists() and young.exists() and other.exists()
    finally:
        listener.close()
    first, second = fresh_core_address("qwen3tts-test"), fresh_core_address("qwen3tts-test")
    assert first != second and first.startswith(f"ipc://{tempfile.gettempdir()}/qwen3tts-test-{os.getpid()}-")


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a process that exited but is not yet reaped (a zombie, its parent gone) has not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_connect_waits_for_a_core_until_told_to_give_up(tmp_path) -> None:
    """A worker waiting for a core that will never serve stops when `give_up` says why; without it, at the
    timeout. Nothing listens at the address."""
    address = f"ipc://{tmp_path}/nobody.sock"
    asked = []

    def give_up() -> str | None:
        asked.append(time.monotonic())
        return "the engine core failed to start: no such model" if len(asked) >= 2 else None

    started = time.monotonic()
    with pytest.raises(EngineNotReadyError, match="no such model"):
        EngineClient.connect(address, timeout=None, give_up=give_up)
    assert len(asked) == 2 and time.monotonic() - started < 5
    with pytest.raises(EngineNotReadyError, match="within 0.3 s"):
        EngineClient.connect(address, timeout=0.3)


def _welcomes(dealer: zmq.Socket, seconds: float) -> int:
    """How many welcomes `dealer` receives within `seconds` (other messages, e.g. stats, are skipped)."""
    count, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if dealer.poll(int(left * 1000)):
            count += dealer.recv_multipart()[0] == ipc.WELCOME
    return count


def test_a_burst_of_hellos_gets_one_welcome_and_a_later_hello_another(core: EngineProcess) -> None:
    """ZeroMQ queues a client's hellos while the core starts, and they arrive together: each welcome carries
    the tokenizer (megabytes), so the burst is answered once. A hello after the burst is answered again:
    a client that lost the core must be able to come back."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"burst-test")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(core.address)
    try:
        for _ in range(20):
            dealer.send_multipart([ipc.HELLO])
        assert _welcomes(dealer, 1.0) == 1
        dealer.send_multipart([ipc.HELLO])
        assert _welcomes(dealer, 1.0) == 1
        dealer.send_multipart([ipc.BYE])
    finally:
        dealer.close()
        context.term()


def test_the_core_process_shares_one_cpu_pool_from_four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below four cores the frame steps have one thread, and a pool per graph lets them borrow the codec's
    idle cores; from four the graphs share ONNX Runtime's one pool (docs/cpu-backend.md)."""
    for cores, pool in ((1, "session"), (2, "session"), (3, "session"), (4, "shared"), (16, "shared")):
        monkeypatch.setattr(torch, "get_num_threads", lambda cores=cores: cores)
        assert cpu_pool_default() == {"QWEN3TTS_CPU_POOL": pool}


def test_the_core_process_runs_the_cpu_graphs_on_its_pool() -> None:
    """On a CPU the core process puts the int8 graphs on ONNX Runtime's shared pool from four cores (it runs
    no other ONNX Runtime sessions, which that pool would refuse); an in-process engine keeps a pool per
    graph, so that other libraries' sessions in the caller's process (Silero VAD) still load. Both speak
    the same codes."""
    address = f"ipc://{os.environ.get('TMPDIR', '/tmp')}/qwen3tts-test-int8-core-{os.getpid()}.sock"
    process = EngineProcess(
        CoreLaunch("synthetic:tiny", address, engine_kwargs={"max_streams": 2, "keep_codes": True, "backend": "int8"},
                   warmup=False),
        restart=False,
    )
    local = engine_for("synthetic:tiny", max_streams=2, backend="int8")
    process.start(timeout=180)
    try:
        client = EngineClient.connect(address, timeout=60)
        try:
            deadline = time.monotonic() + 10
            while not client.stats().kernel_paths and time.monotonic() < deadline:  # the core's stats come every 250 ms
                time.sleep(0.05)
            shared = cpu_pool_default()["QWEN3TTS_CPU_POOL"] == "shared"
            assert client.stats().kernel_paths["talker"] == f"onnxruntime (int8{', shared pool' if shared else ''})"
            assert local.stats().kernel_paths["talker"] == "onnxruntime (int8)"
            voice = Voice(prompt=local.create_voice(reference_audio(), "This is my voice."))
            remote = Voice(prompt=client.create_voice(reference_audio(), "This is my voice."))
            _, ours = local.synthesize_blocking(TEXT, voice=voice, sampling=GREEDY)
            _, theirs = client.synthesize_blocking(TEXT, voice=remote, sampling=GREEDY)
            assert theirs.codes == ours.codes and len(ours.codes) == 8
        finally:
            client.close()
    finally:
        local.close()
        process.stop()


def test_a_client_refuses_and_admits_as_soon_as_its_core_does(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The API workers refuse new streams (`busy`) from the last stats their core published. The stats come every
    `STATS_INTERVAL_S` (here 3 s, 250 ms as shipped) and, when the engine starts or stops refusing, at once: a
    client follows its core within a fraction of a second both ways, not up to a whole interval later. The
    engine is the real one in this process, refusing while a request waits for a slot (both slots held by
    streams waiting for their callers' text), behind a real `CoreServer` and `EngineClient`."""
    monkeypatch.setattr(core_server, "STATS_INTERVAL_S", 3.0)
    engine = HostedEngine(official_model("synthetic:tiny"), backend="torch", max_streams=2, shed_when_behind=True)
    server = CoreServer(engine, f"ipc://{tmp_path}/core.sock")
    server.start()
    client = EngineClient.connect(server.address, timeout=60, dead_after_s=30.0)
    holders: list[Any] = []
    try:
        voice = Voice(prompt=client.create_voice(reference_audio(), None, x_vector_only=True))
        short = SamplingParams.greedy(max_frames=4, ignore_eos=True)
        holders = [client.open_stream(voice=voice, sampling=SamplingParams.greedy(max_frames=200)) for _ in range(2)]
        for holder in holders:
            holder.push_text("Hello there, ")  # a few frames, then a wait for more text, in its slot
        wait_for(lambda: len(engine.core.scheduler.running) == 2, 60, "both slots held")
        queued = client.open_stream(TEXT, voice=voice, sampling=short)
        wait_for(lambda: engine.refusal_reason() is not None, 30, "the core refusing while a request waits for a slot")
        assert wait_for(lambda: client.stats().overloaded, 10, "the client refusing too") < 1.0
        with pytest.raises(EngineOverloadedError) as refused:
            client.open_stream(TEXT, voice=voice, sampling=short)
        assert refused.value.reason == "slot_wait"  # the core's rule, in its stats

        holders[0].cancel()  # the queued request takes the freed slot: the core admits again
        wait_for(lambda: engine.refusal_reason() is None, 30, "the core admitting again")
        assert wait_for(lambda: not client.stats().overloaded, 10, "the client admitting too") < 1.0
        assert sum(chunk.frame_end - chunk.frame_start for chunk in queued.chunks(timeout=60)) == 4
        pcm = [chunk.pcm for chunk in client.open_stream(TEXT, voice=voice, sampling=short).chunks(timeout=60)]
        assert sum(len(p) for p in pcm) == 4 * 1920
    finally:
        for holder in holders:
            holder.cancel()
        client.close()
        server.stop()
        engine.close()


def test_chunks_past_zeromqs_copy_threshold_arrive_whole(tmp_path) -> None:
    """A chunk's PCM goes to the socket as the array itself (`ipc.encode_chunk`); from 64 KiB ZeroMQ sends it without
    a copy, holding the array until the message has left. 16-frame chunks (120 KiB) through a real `CoreServer` and
    `EngineClient` carry exactly the audio the same engine hands an in-process stream."""
    engine = HostedEngine(official_model("synthetic:tiny"), backend="torch", max_streams=2, chunk_schedule=(16,), adapt_chunks=False)
    server = CoreServer(engine, f"ipc://{tmp_path}/core.sock")
    server.start()
    client = EngineClient.connect(server.address, timeout=60)
    try:
        sampling = SamplingParams.greedy(max_frames=32, ignore_eos=True)
        voice = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
        local = [c.pcm for c in engine.open_stream(TEXT, voice=voice, sampling=sampling).chunks(timeout=120)]
        remote = [c.pcm for c in client.open_stream(TEXT, voice=voice, sampling=sampling).chunks(timeout=120)]
        assert [len(p) for p in remote] == [len(p) for p in local] == [16 * 1920, 16 * 1920]
        assert all(np.array_equal(r, loc) for r, loc in zip(remote, local, strict=True))
    finally:
        client.close()
        server.stop()
        engine.close()


def test_a_chunk_crosses_the_wire_with_its_audio_frames_and_every_timing() -> None:
    timings = ChunkTimings(1.5, 2.25, 3.125, 4.0625, admitted=1.75, arrived=1.25)
    pcm = np.linspace(-1.0, 1.0, 3840, dtype=np.float32)
    output = ChunkOutput("worker-1:req-7", pcm, 8, 16, True, timings)
    kind, header, payload = ipc.encode_chunk(output, "req-7")
    assert kind == ipc.CHUNK
    received = ipc.decode_chunk(header, bytes(payload))  # the bytes a receiving socket hands on
    assert received.request_id == "req-7" and (received.frame_start, received.frame_end, received.is_last) == (8, 16, True)
    assert received.timings == timings
    assert np.array_equal(received.pcm, pcm) and received.pcm.dtype == np.float32
