"""The Serve application on a local Ray cluster: two replicas of the tiny engine behind one proxy.

Real parts throughout: a Ray cluster started here, Serve's proxy on a loopback port, the replicas'
engines, and `websockets`/`httpx` clients. One application serves every test of the module (a Ray start
and two replica starts are most of its time); the test that kills a replica runs last and waits for
Serve to bring it back.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve import Application
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.config import AutoscalingConfig
from ray.serve.request_router import PendingRequest, ReplicaID
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from qwen3tts_agent.ray.app import (
    ENGINE_DEPLOYMENT,
    app_builder,
    build_app,
    config_settings,
    deployment_options,
)
from qwen3tts_agent.ray.autoscaling import (
    ENGINE_LOAD_METRIC,
    EngineLoadPolicy,
    LoadMeter,
    engine_load,
    engine_load_policy,
)
from qwen3tts_agent.ray.proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from qwen3tts_agent.ray.replica import REPLICA_HEADER
from qwen3tts_agent.ray.router import LoadAwareRouter, ReplicaLoad, rank_by_load
from qwen3tts_agent.ray.settings import RayServeSettings
from qwen3tts_agent.ray.transport import PROXY_LIMITS_ENV, proxy_limits_environment
from qwen3tts_agent.server.config import ServerConfig
from tests.ray_session import Session, answer_to_half_a_head

APP = "qwen3tts-test"
API_KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SLOTS = 2  # synthesis slots per replica: small, so "full" is cheap to reach


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_settings(voices_dir: Path) -> RayServeSettings:
    """Two replicas of the tiny engine, half a Ray CPU each, engine cores in processes; quick health checks
    and load reports so failures and routing show within a second."""
    return RayServeSettings(
        model="synthetic:tiny",
        server=ServerConfig(
            api_key=API_KEY, model_name="synthetic:tiny", voices_dir=voices_dir,
            max_frames=2000, max_active_streams=SLOTS, max_queued=0, idle_timeout_s=60.0,
        ),
        num_replicas=2, num_cpus=0.5, torch_threads=1, max_streams=4, engine_core="process",
        health_check_period_s=0.5, routing_stats_period_s=0.2, graceful_shutdown_timeout_s=2.0, app_name=APP,
    )


# Serve's processes read these at start: the proxy's middleware, and its connection limits (short, so the
# tests of clients that stall see them act; the replicas' own limits are `app_settings`'). (How often the proxies
# and the replicas send the autoscaler their metrics is the autoscaling config's `metrics_interval_s`, 10 s: Ray
# 2.60 defines the RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S variables but reads neither.)
PROXY_READ_TIMEOUT_S = 1.0
PROXY_SEND_TIMEOUT_S = 2.0
CLUSTER_ENV = {
    PROXY_CALLBACK_ENV: PROXY_CALLBACK,
    **proxy_limits_environment(ServerConfig(
        http_read_timeout_s=PROXY_READ_TIMEOUT_S, send_timeout_s=PROXY_SEND_TIMEOUT_S, send_buffer_bytes=16384,
    )),
}


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    saved = {name: os.environ.get(name) for name in CLUSTER_ENV}
    os.environ.update(CLUSTER_ENV)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_settings(tmp_path_factory.mktemp("voices"))), name=APP, route_prefix="/")
        yield f"127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value



def metric_values(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def per_replica(text: str, name: str, **labels: str) -> dict[str, float]:
    """`name`'s value per replica in `/metrics/replicas`, over the samples matching `labels`."""
    totals: dict[str, float] = {}
    for key, value in metric_values(text, name).items():
        d = dict(key)
        if all(d.get(k) == v for k, v in labels.items()):
            totals[d["replica"]] = totals.get(d["replica"], 0.0) + value
    return totals


def tuple_address(url: str) -> tuple[str, int]:
    host, port = url.split(":")
    return host, int(port)


def live(url: str) -> float:
    """Streams open or queued on the replicas, by the server's own gauges summed over them (`/metrics`)."""
    text = scrape(url)
    return sum(sum(metric_values(text, name).values()) for name in ("qwen3tts_active_streams", "qwen3tts_queued_requests"))


async def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        await asyncio.sleep(0.2)


def scrape(url: str, path: str = "/metrics") -> str:
    response = httpx.get(f"http://{url}{path}", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.text


REPLICA_ACTOR_PREFIX = f"SERVE_REPLICA::{APP}#{ENGINE_DEPLOYMENT}#"


def core_process(replica: str) -> int:
    """The pid of a replica's engine-core process (its child started through multiprocessing's spawn)."""
    actor = ray.get_actor(REPLICA_ACTOR_PREFIX + replica, namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _replica: os.getpid()), timeout=30)
    children = [int(child) for task in os.listdir(f"/proc/{pid}/task") for child in _read_proc(f"{pid}/task/{task}/children").split()]
    cores = [c for c in children if "spawn_main" in _read_proc(f"{c}/cmdline")]
    assert len(cores) == 1, (pid, children)
    return cores[0]


def _read_proc(path: str) -> str:
    """A /proc file's text, or "" if its thread or process ended since it was listed (threads come and go)."""
    try:
        return Path(f"/proc/{path}").read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return ""


def process_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


async def wait_for_replacement(gone: str, timeout: float = 120) -> set[str]:
    """Two replicas running again, `gone` not among them."""
    deadline = time.monotonic() + timeout
    replicas: set[str] = set()
    while time.monotonic() < deadline:
        replicas = replicas_running()
        if len(replicas) == 2 and gone not in replicas:
            return replicas
        await asyncio.sleep(0.5)
    raise AssertionError(f"not replaced within {timeout} s: {replicas}, {serve.status()}")


async def wait_for_replicas(count: int, timeout: float = 120) -> set[str]:
    deadline = time.monotonic() + timeout
    replicas: set[str] = set()
    while time.monotonic() < deadline:
        replicas = replicas_running()
        if len(replicas) == count:
            return replicas
        await asyncio.sleep(0.5)
    raise AssertionError(f"not {count} replicas within {timeout} s: {replicas}, {serve.status()}")


def replicas_running() -> set[str]:
    """Ids of the engine replicas alive, once Serve counts every one of them as running."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    alive = {n.removeprefix(REPLICA_ACTOR_PREFIX) for n in names if n.startswith(REPLICA_ACTOR_PREFIX)}
    status = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT]
    return alive if status.replica_states.get("RUNNING", 0) == len(alive) else set()


async def test_sessions_spread_over_both_replicas_and_stay_on_theirs(serve_url: str) -> None:
    before = scrape(serve_url, "/metrics/replicas")
    sessions = await asyncio.gather(*(Session.open(serve_url, AUTH, max_frames=6) for _ in range(4)))
    try:
        placement = Counter(s.replica for s in sessions)
        assert sorted(placement.values()) == [2, 2], placement  # the least loaded replica takes each session
        for _ in range(3):  # three utterances per session, all on the replica that took the session
            for s in sessions:
                await s.say("Hello there, how can I help?")
            for s in sessions:
                done, pcm = await s.until("done")
                assert done["finish_reason"] == "max_frames" and pcm == 6 * 1920 * 2
    finally:
        await asyncio.gather(*(s.close() for s in sessions))
    await asyncio.sleep(1.5)  # a push of each replica's metrics
    after = scrape(serve_url, "/metrics/replicas")
    grew = {
        replica: value - per_replica(before, "qwen3tts_utterances_total", endpoint="ws").get(replica, 0.0)
        for replica, value in per_replica(after, "qwen3tts_utterances_total", endpoint="ws").items()
    }
    assert {r: n for r, n in grew.items() if n} == {r: 3.0 * n for r, n in placement.items()}


async def test_a_full_replica_is_passed_over_and_busy_comes_only_when_all_are_full(serve_url: str) -> None:
    held: list[Session] = []
    try:
        for _ in range(2 * SLOTS):  # unflushed text holds a synthesis slot until the flush
            s = await Session.open(serve_url, AUTH, max_frames=4)
            await s.say("Hold this slot", flush=False)
            held.append(s)
            await asyncio.sleep(0.5)  # its slot shows in the replica's next report
        assert sorted(Counter(s.replica for s in held).values()) == [SLOTS, SLOTS]
        extra = await Session.open(serve_url, AUTH, max_frames=4)
        await extra.say("No room left")
        error, _ = await extra.until("error")
        assert (error["code"], error["status"]) == ("busy", 503)
        await extra.close()
        for s in held:
            await s.ws.send(json.dumps({"type": "flush"}))
            done, pcm = await s.until("done")
            assert done["finish_reason"] == "max_frames" and pcm > 0
    finally:
        await asyncio.gather(*(s.close() for s in held))


async def test_openai_speech_and_the_servers_error_shapes_through_serve(serve_url: str) -> None:
    body = {"model": "tts-1", "input": "Hello there!", "voice": "alloy", "response_format": "pcm",
            "sampling": {"max_frames": 5, "ignore_eos": True, "seed": 3}}
    await asyncio.sleep(1.0)  # both replicas' reports no longer count the last test's sessions
    async with httpx.AsyncClient(base_url=f"http://{serve_url}", timeout=60) as client:
        answers = [await client.post("/v1/audio/speech", json=body, headers=AUTH) for _ in range(4)]
        assert {r.status_code for r in answers} == {200}
        assert {len(r.content) for r in answers} == {5 * 1920 * 2}
        assert len({r.content for r in answers}) == 1  # the same weights and seed on every replica
        assert len({r.headers[REPLICA_HEADER] for r in answers}) == 2
        wav = await client.post("/v1/audio/speech", json={**body, "response_format": "wav"}, headers=AUTH)
        assert wav.status_code == 200 and wav.content[:4] == b"RIFF"

        refused = await client.post("/v1/audio/speech", json=body)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        slow = await client.post("/v1/audio/speech", json={**body, "speed": 2.0}, headers=AUTH)
        assert slow.status_code == 400 and slow.json()["error"]["code"] == "unsupported_parameter"
        unknown = await client.get("/v1/nothing-here", headers=AUTH)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        voices = await client.get("/v1/voices", headers=AUTH)
        assert voices.status_code == 200 and "alloy" in voices.json()["openai_voices"]
        with pytest.raises(InvalidStatus) as denied:  # the WebSocket handshake's gates, in the same shapes
            await connect(f"ws://{serve_url}/v1/stream")
        assert denied.value.response.status_code == 401
        assert json.loads(denied.value.response.body)["error"]["code"] == "unauthorized"
        ready = await client.get("/ready")
        assert ready.json() == {"status": "ready", "model": "synthetic:tiny"}


def test_metrics_are_summed_over_replicas_and_kept_apart_per_replica(serve_url: str) -> None:
    time.sleep(1.5)  # every replica's last utterances reached the hub (a scrape sees the others' last push)
    summed = scrape(serve_url)
    split = scrape(serve_url, "/metrics/replicas")
    slots = metric_values(summed, "qwen3tts_engine_max_streams")
    assert slots == {(): 2 * 4.0}  # both engines' slots
    assert set(per_replica(split, "qwen3tts_engine_max_streams").values()) == {4.0}
    for name in ("qwen3tts_utterances_total", "qwen3tts_first_audio_seconds_count"):
        total = sum(metric_values(summed, name).values())
        assert total > 0 and total == pytest.approx(sum(per_replica(split, name).values()))
    assert httpx.get(f"http://{serve_url}/metrics", timeout=10).status_code == 401


def test_without_direct_ingress_the_replicas_have_no_ports_of_their_own(serve_url: str) -> None:
    listed = httpx.get(f"http://{serve_url}/v1/replicas", headers=AUTH, timeout=30)  # see test_ray_direct_ingress.py
    assert listed.status_code == 200 and listed.json() == {"direct_ingress": False, "replicas": []}


def test_the_proxy_closes_a_request_head_that_never_ends(serve_url: str) -> None:
    """Stock uvicorn, which Serve's proxy runs, keeps a connection that sends half a request head for good; the
    proxy answers 408 and closes after its `http_read_timeout_s`, as `serve` does."""
    answer, seconds = answer_to_half_a_head(*tuple_address(serve_url), PROXY_READ_TIMEOUT_S + 10)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:200]
    assert seconds < PROXY_READ_TIMEOUT_S + 3


async def test_a_client_that_stops_reading_through_the_proxy_frees_its_replicas_slot(serve_url: str) -> None:
    """Serve's proxy app waits on a client that stopped reading for good: the replica's session behind it held
    its slot until the replica's own send timeout (10 s here, through Serve's relay) and the client's connection
    stayed open after. The proxy aborts such a connection after its `send_timeout_s`, the replica sees the client
    leave, and the slot comes back (the server's gauges return to 0) well before the replica's timeout. (That the
    proxy aborted the connection is read from its log: what the client then reads depends on the kernels' TCP
    timers, as the aborted socket still holds data for a client that does not read, and did not always end within
    10 s on a loaded machine.)"""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a tiny window stalls the proxy fast
    sock.connect(tuple_address(serve_url))
    sock.setblocking(False)
    ws = await connect(f"ws://{serve_url}/v1/stream", additional_headers=AUTH, sock=sock, max_queue=1, proxy=None)
    await ws.send(json.dumps({"type": "start", "sampling": {"ignore_eos": True, "seed": 3, "max_frames": 2000},
                              "audio_format": {"encoding": "pcm_f32le", "sample_rate": 48000}}))  # 15 KB a frame
    await ws.send(json.dumps({"type": "text", "text": "Nobody reads this."}))
    await ws.send(json.dumps({"type": "flush"}))
    await wait_until(lambda: live(serve_url) > 0, 30, "the stalled client's stream started")
    stalled = time.monotonic()
    await wait_until(lambda: live(serve_url) == 0, 60, "the stalled client's stream ended")
    assert time.monotonic() - stalled < PROXY_SEND_TIMEOUT_S + 6  # measured: 2.2 s, and 15 s without the deadline
    await wait_until(lambda: "closing a WebSocket whose client read nothing" in proxy_log_text("worker-*.err"), 10,
                     "the proxy's log of the connection it aborted")
    ws.transport.abort()


def proxy_log_text(files: str = "serve/proxy_*.log") -> str:
    """What this cluster has logged so far in its log folder's `files`: by default Serve's proxies' own logs (their
    access lines and their errors); "worker-*.err" is its worker processes' stderr, where the proxy middleware's
    log lines go."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return "".join(path.read_text(errors="replace") for path in sorted(logs.glob(files)))


async def test_sessions_that_close_as_done_arrives_end_as_normal_closes_in_the_proxy(serve_url: str) -> None:
    """A client that sends `close` and shuts its socket as its `done` arrives (as benchmarks/serving/load.py does)
    races the replica's own close. uvicorn refuses the proxy's relay of that close (ClientDisconnected), and
    Serve's proxy, handed the exception, abandoned the request and logged it as failed: 15 of 40 such sessions
    here, about half of those of a GPU load run. The proxy's middleware drops what can no longer be delivered,
    so every session ends as a normal close in the proxy's access log."""
    access = re.compile(r" WS /\S* 1000 ")
    before = proxy_log_text()
    rounds, per_round = 10, 2
    for _ in range(rounds):
        sessions = await asyncio.gather(*(Session.open(serve_url, AUTH, max_frames=3) for _ in range(per_round)))
        for s in sessions:
            await s.say("Goodbye.")

        async def close_on_done(s: Session) -> None:
            done, _ = await s.until("done")
            assert done["finish_reason"] == "max_frames"
            await s.ws.send(json.dumps({"type": "close"}))
            await s.close()

        await asyncio.gather(*(close_on_done(s) for s in sessions))
    await wait_until(
        lambda: len(access.findall(proxy_log_text())) - len(access.findall(before)) == rounds * per_round, 10,
        "an access line for every session in the proxy's log",
    )
    after = proxy_log_text()
    assert after.count("unexpected error") == before.count("unexpected error"), after[len(before):][-3000:]


async def test_a_replica_whose_engine_died_is_passed_over_and_replaced(serve_url: str) -> None:
    sessions = await asyncio.gather(*(Session.open(serve_url, AUTH, max_frames=4) for _ in range(2)))
    sick = sessions[0].replica
    os.kill(core_process(sick), 9)
    await sessions[0].say("Anyone there?")
    error, _ = await sessions[0].until("error")
    assert error["code"] in ("engine_error", "not_ready"), error
    await asyncio.gather(*(s.close() for s in sessions))
    await asyncio.sleep(0.5)  # the sick replica's report reaches the router
    for _ in range(3):  # meanwhile every new session goes to the healthy replica, and is served
        s = await Session.open(serve_url, AUTH, max_frames=4)
        assert s.replica != sick
        await s.say("Hello?")
        done, _ = await s.until("done")
        assert done["finish_reason"] == "max_frames"
        await s.close()
    replicas = await wait_for_replacement(sick)  # its health checks failed: Serve started another
    assert len(replicas - {s.replica}) == 1


async def test_a_replica_killed_mid_stream_ends_its_sessions_cleanly_and_serve_replaces_it(serve_url: str) -> None:
    victim = await Session.open(serve_url, AUTH, max_frames=2000)  # far longer than the test
    await victim.say("A long answer that is cut short when its replica dies.")
    await victim.until("audio")
    core = core_process(victim.replica)
    ray.kill(ray.get_actor(REPLICA_ACTOR_PREFIX + victim.replica, namespace="serve"), no_restart=True)
    killed = time.monotonic()
    error, _ = await victim.until("error", timeout=30)
    assert (error["code"], error["status"]) == ("engine_error", 500)
    with pytest.raises(ConnectionClosed) as closed:
        await asyncio.wait_for(victim.ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
    assert time.monotonic() - killed < 30

    survivor = await Session.open(serve_url, AUTH, max_frames=4)  # the next session succeeds elsewhere
    assert survivor.replica != victim.replica
    await survivor.say("Still here.")
    done, pcm = await survivor.until("done")
    assert done["finish_reason"] == "max_frames" and pcm > 0
    await survivor.close()

    await wait_for_replacement(victim.replica)
    assert process_gone(core)  # Ray ended the dead replica's engine-core process with it
    seen: set[str] = set()
    for _ in range(6):
        s = await Session.open(serve_url, AUTH, max_frames=2)
        seen.add(s.replica)
        await s.close()
    assert victim.replica not in seen and len(seen) == 2  # the replacement takes sessions too


async def test_autoscaling_adds_a_replica_for_sessions_and_removes_it_after(serve_url: str, tmp_path: Path) -> None:
    """Redeploys the application autoscaled (runs after the tests of the fixed two replicas)."""
    settings = replace(
        app_settings(tmp_path), num_replicas=None, min_replicas=1, max_replicas=2, autoscale_on="ongoing-requests",
        target_ongoing_requests=2, look_back_period_s=1.0, upscale_delay_s=0.5, downscale_delay_s=2.0,
    )
    serve.run(build_app(settings), name=APP, route_prefix="/")
    first = await wait_for_replicas(1)
    sessions = [await Session.open(serve_url, AUTH, max_frames=4) for _ in range(4)]  # twice the target of one replica
    assert {s.replica for s in sessions} == first
    grown = await wait_for_replicas(2)
    newcomer = await Session.open(serve_url, AUTH, max_frames=4)
    assert {newcomer.replica} == grown - first  # the new, idle replica takes the next session
    await newcomer.say("Hello from the new replica.")
    done, _ = await newcomer.until("done")
    assert done["finish_reason"] == "max_frames"
    await asyncio.gather(*(s.close() for s in [*sessions, newcomer]))
    assert len(await wait_for_replicas(1)) == 1  # idle again: back to min_replicas


async def test_engine_load_autoscaling_adds_a_replica_for_busy_slots_and_removes_it_after(
    serve_url: str, tmp_path: Path
) -> None:
    """Redeploys the application autoscaled on engine load. Two sessions that hold the one replica's two slots
    (load 1.0 against a target of 0.6) bring the second replica; as ongoing requests they are 2, an eighth of the
    default target of that signal. Once they end, the load is 0 and Serve goes back to one replica.

    The proxy's router learns of the new replica and of its first load report by long poll, a moment after
    Serve's controller counts it running: until then the full replica is the only one it knows, and a session
    opened in that moment waits there for a slot, as on any deployment whose every replica is full. So the
    newcomer is the first session to reach the new replica within a few seconds of it running; those opened
    before (no text sent: they hold no slot) are closed."""
    settings = replace(
        app_settings(tmp_path), num_replicas=None, min_replicas=1, max_replicas=2, autoscale_on="engine-load",
        target_engine_load=0.6, look_back_period_s=1.0, upscale_delay_s=0.5, downscale_delay_s=2.0,
    )
    serve.run(build_app(settings), name=APP, route_prefix="/")
    first = await wait_for_replicas(1)
    held: list[Session] = []
    newcomer: Session | None = None
    try:
        for _ in range(SLOTS):  # unflushed text holds a synthesis slot until the flush
            s = await Session.open(serve_url, AUTH, max_frames=4)
            await s.say("Hold this slot", flush=False)
            held.append(s)
        assert {s.replica for s in held} == first
        grown = await wait_for_replicas(2)
        newcomer = await session_on(serve_url, grown - first, within=10.0)  # the full replica is passed over for the new one
        await newcomer.say("Hello from the new replica.")
        done, _ = await newcomer.until("done")
        assert done["finish_reason"] == "max_frames"
        for s in held:
            await s.ws.send(json.dumps({"type": "flush"}))
            done, pcm = await s.until("done")
            assert done["finish_reason"] == "max_frames" and pcm > 0
    finally:
        await asyncio.gather(*(s.close() for s in [*held, *([newcomer] if newcomer else [])]))
    assert len(await wait_for_replicas(1)) == 1  # no load left: back to min_replicas


async def session_on(url: str, replicas: set[str], within: float) -> Session:
    """The first session opened through the proxy that lands on one of `replicas`, opening one every quarter
    second for up to `within` seconds (sessions that land elsewhere are closed at once)."""
    deadline = time.monotonic() + within
    elsewhere: list[str] = []
    while True:
        session = await Session.open(url, AUTH, max_frames=4)
        if session.replica in replicas:
            return session
        elsewhere.append(session.replica)
        await session.close()
        if time.monotonic() > deadline:
            raise AssertionError(f"no session on {replicas} within {within} s: {elsewhere}")
        await asyncio.sleep(0.25)


def _context(
    loads: dict[str, float] | None, *, running: str = "ab", target: int = 2, min_replicas: int = 1,
    max_replicas: int = 4, policy_state: dict[str, Any] | None = None, config: Any = None,
) -> Any:
    """An AutoscalingContext as Serve's controller builds it, with engine-load reports of the replicas named."""
    from ray.serve.config import AutoscalingContext

    deployment = DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP)
    replica = {name: ReplicaID(name, deployment) for name in "abcdef"}
    return AutoscalingContext(
        deployment_id=deployment, deployment_name=ENGINE_DEPLOYMENT, app_name=APP,
        current_num_replicas=len(running), target_num_replicas=target,
        running_replicas=[replica[name] for name in running],
        total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=None if loads is None else {
            ENGINE_LOAD_METRIC: {replica[name]: load for name, load in loads.items()}
        },
        raw_metrics=None, capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state=policy_state or {}, last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=config,
    )


def test_the_engine_load_policy_wants_the_replicas_that_bring_the_mean_load_to_its_target() -> None:
    def wanted(loads: dict[str, float] | None, **kw: Any) -> int:
        count, state = engine_load_policy(_context(loads, **kw), 0.6)
        assert state == {}
        return count

    assert wanted({"a": 0.9, "b": 0.9}) == 3  # 1.8 replicas' worth of load / 0.6 per replica
    assert wanted({"a": 0.6, "b": 0.6}) == 2  # on target: as many as now (1.2 / 0.6 is 2.0000000000000004)
    assert wanted({"a": 0.2, "b": 0.3}) == 1  # 0.5 fits one replica at 0.6
    assert wanted({"a": 1.0, "b": 1.0, "c": 1.0}, running="abc", target=3) == 4  # clamped to max_replicas
    assert wanted({"a": 0.0, "b": 0.0}, min_replicas=2) == 2  # clamped to min_replicas
    assert wanted(None) == 2 and wanted({}) == 2  # nothing reported yet: hold the current target
    assert wanted({"a": 1.2}) == 2  # b started and has not reported: it carries nothing yet
    assert wanted({"a": 0.3, "c": 5.0}) == 1  # c is not running any more: its last report is ignored
    assert EngineLoadPolicy(0.5)(_context({"a": 0.9, "b": 0.9})) == (4, {})
    with pytest.raises(ValueError, match="target_engine_load"):
        EngineLoadPolicy(1.5)


def test_serve_applies_its_delays_and_bounds_to_the_engine_load_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the controller's own path: the policy from the deployment's options, resolved and wrapped as
    Serve's controller does (`_resolve_policy_callable`, `_apply_autoscaling_config`), on a clock of our own."""
    from types import SimpleNamespace

    from ray.serve import autoscaling_policy
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    settings = RayServeSettings(model="m", num_replicas=None, min_replicas=1, max_replicas=3,
                                target_engine_load=0.6, upscale_delay_s=30.0, downscale_delay_s=600.0)
    config = AutoscalingConfig(**deployment_options(settings)["autoscaling_config"])
    policy = autoscaling_policy._apply_autoscaling_config(_resolve_policy_callable(config.policy))
    now = [1000.0]
    monkeypatch.setattr(autoscaling_policy, "time", SimpleNamespace(time=lambda: now[0]))
    state: dict[str, Any] = {}

    def tick(seconds: float, loads: dict[str, float], target: int) -> int:
        nonlocal state
        now[0] += seconds
        count, state = policy(_context(loads, running="abc"[:target], target=target, max_replicas=3,
                                       policy_state=state, config=config))
        return count

    assert tick(0, {"a": 0.9}, 1) == 1  # over target: the wish to upscale starts now
    assert tick(29, {"a": 0.9}, 1) == 1  # ... and holds 29 s: not yet
    assert tick(1, {"a": 0.9}, 1) == 2  # 30 s (upscale_delay_s): one more replica
    assert tick(10, {"a": 0.5, "b": 0.5}, 2) == 2  # on target (1.0 / 0.6 -> 2): nothing to do
    assert tick(1, {"a": 0.2, "b": 0.1}, 2) == 2  # under: the wish to downscale starts
    assert tick(300, {"a": 0.2, "b": 0.1}, 2) == 2
    assert tick(1, {"a": 0.5, "b": 0.4}, 2) == 2  # back on target: the wish is forgotten
    assert tick(1, {"a": 0.2, "b": 0.1}, 2) == 2
    assert tick(599, {"a": 0.2, "b": 0.1}, 2) == 2  # 599 s of the new wish: not yet
    assert tick(1, {"a": 0.2, "b": 0.1}, 2) == 1  # 600 s (downscale_delay_s): one replica fewer
    assert tick(0, {"a": 3.0}, 1) == 1  # far over target: 5 wanted, but only after the upscale delay...
    assert tick(30, {"a": 3.0}, 1) == 3  # ... and then max_replicas


def test_the_engine_load_of_a_replica_and_its_mean_between_reads() -> None:
    assert engine_load(busy=1, capacity=4, sessions=2, max_sessions=64, overloaded=False) == 0.25
    assert engine_load(busy=6, capacity=4, sessions=6, max_sessions=64, overloaded=False) == 1.5  # queued
    assert engine_load(busy=1, capacity=4, sessions=48, max_sessions=64, overloaded=False) == 0.75  # sessions
    assert engine_load(busy=1, capacity=4, sessions=2, max_sessions=64, overloaded=True) == 1.0  # refusing
    assert engine_load(busy=0, capacity=0, sessions=0, max_sessions=0, overloaded=False, available=False) == 1.0
    meter = LoadMeter()
    assert meter.take(0.5, now=10.0) == 0.5  # nothing sampled before: this sample
    meter.observe(1.0, now=11.0)  # 0.5 held for 1 s, then 1.0 ...
    meter.observe(0.0, now=14.0)  # ... for 3 s, then 0.0 ...
    assert meter.take(0.0, now=18.0) == pytest.approx((0.5 * 1 + 1.0 * 3) / 8)  # ... for 4 s
    assert meter.take(0.0, now=20.0) == 0.0  # a new window: only what came after the last read


def test_settings_from_a_serve_config_refuse_unknown_keys(tmp_path: Path) -> None:
    settings = RayServeSettings.from_dict(
        {"model": "synthetic:tiny", "num_replicas": 2, "server": {"max_sessions": 8, "voices_dir": str(tmp_path)}}
    )
    assert settings.server.max_sessions == 8 and settings.server.voices_dir == tmp_path
    assert settings.server.model_name == "synthetic:tiny"
    assert RayServeSettings.from_dict(settings.to_dict()) == settings
    with pytest.raises(ValueError, match="replica_count"):
        RayServeSettings.from_dict({"model": "m", "replica_count": 2})
    with pytest.raises(ValueError, match="max_session"):
        RayServeSettings.from_dict({"model": "m", "server": {"max_session": 2}})
    with pytest.raises(ValueError, match="engine_core"):
        RayServeSettings(model="m", engine_core="fiber").validate()
    # autoscaling: on engine load unless told otherwise; a config written before `autoscale_on` existed, with
    # its target of ongoing requests, keeps autoscaling on them
    assert RayServeSettings.from_dict({"model": "m", "num_replicas": None}).autoscale_on == "engine-load"
    older = RayServeSettings.from_dict({"model": "m", "num_replicas": None, "target_ongoing_requests": 48})
    assert (older.autoscale_on, older.target_ongoing_requests) == ("ongoing-requests", 48)
    with pytest.raises(ValueError, match="autoscale_on"):
        RayServeSettings(model="m", autoscale_on="gpu-temperature").validate()
    with pytest.raises(ValueError, match="target_engine_load"):
        RayServeSettings(model="m", target_engine_load=0).validate()


def test_serve_ray_passes_serves_scheduling_options_to_every_replicas_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """`serve-ray` takes `serve`'s scheduling options (the two share `add_server_arguments`): each reaches the
    replicas' `Engine` keywords in the engine's units, through a printed Serve config as well, and a bad value
    in a config file is refused by the option's name before any replica starts."""
    import yaml

    from qwen3tts_agent.cli import main

    options = ["--codec-hold-ms", "30", "--step-period-ms", "15", "--first-frame-step-load", "0",
               "--clock-first-frame-load", "64", "--shed-lateness-ms", "20", "--chunk-schedule", "1,1,2,4,8",
               "--max-seq-len", "512"]
    assert main(["serve-ray", "--model", "synthetic:tiny", "--num-gpus", "0.5", *options, "--print-config"]) == 0
    settings = RayServeSettings.from_dict(yaml.safe_load(capsys.readouterr().out)["applications"][0]["args"])
    assert settings.engine_kwargs() == {
        "max_streams": "auto", "backend": "auto", "device_share": 0.5, "codec_hold_s": 0.03, "step_period_s": 0.015,
        "first_frame_step_load": 0, "clock_first_frame_load": 64, "shed_lateness_s": 0.02, "max_seq_len": 512,
        "chunk_schedule": (1, 1, 2, 4, 8),
    }
    assert RayServeSettings(model="m").engine_kwargs() == {"max_streams": "auto", "backend": "auto"}
    with pytest.raises(ValueError, match="shed_lateness_ms"):
        RayServeSettings(model="m", shed_lateness_ms=-1).validate()
    with pytest.raises(ValueError, match="chunk schedule"):
        RayServeSettings.from_dict({"model": "m", "chunk_schedule": [1, 0]}).validate()


def test_serve_ray_tells_gpu_engine_load_autoscaling_to_cap_the_slots(capsys: pytest.CaptureFixture[str]) -> None:
    """Measured on an H100: a half-GPU replica with `--max-streams auto` reached the load target only as its streams
    began to underrun (the slots fit memory, not compute). `serve-ray` says so where that setup is asked for, and
    not otherwise."""
    from qwen3tts_agent.cli import main

    def note(*options: str) -> bool:
        assert main(["serve-ray", "--model", "synthetic:tiny", *options, "--print-config"]) == 0
        return "--max-active-streams" in capsys.readouterr().err

    assert note("--num-gpus", "0.5", "--max-replicas", "2")
    assert note("--num-gpus", "1", "--min-replicas", "1", "--max-replicas", "4")
    assert not note("--num-gpus", "0.5", "--max-replicas", "2", "--max-active-streams", "48")  # capped
    assert not note("--num-gpus", "0.5", "--max-replicas", "2", "--max-streams", "64")  # chosen slots
    assert not note("--num-gpus", "0", "--max-replicas", "2")  # CPU replicas
    assert not note("--num-gpus", "0.5", "--replicas", "2")  # no autoscaling
    assert not note("--num-gpus", "0.5", "--max-replicas", "2", "--autoscale-on", "ongoing-requests")


def _report(busy: int = 0, *, capacity: int = 2, sessions: int = 0, healthy: bool = True, overloaded: bool = False) -> dict[str, Any]:
    return {"at": 1.0, "ready": True, "healthy": healthy, "overloaded": overloaded, "capacity": capacity,
            "busy": busy, "sessions": sessions, "max_sessions": 64}


def test_the_router_ranks_free_replicas_first_then_full_ones_then_those_down() -> None:
    loads = {
        "down": ReplicaLoad.from_stats(_report(healthy=False)),
        "full": ReplicaLoad.from_stats(_report(busy=2)),
        "half": ReplicaLoad.from_stats(_report(busy=1)),
        "behind": ReplicaLoad.from_stats(_report(overloaded=True)),  # shedding load: as good as full
        "idle": ReplicaLoad.from_stats(_report(sessions=3)),
        "idler": ReplicaLoad.from_stats(_report()),
        "new": ReplicaLoad.from_stats({}),  # not reported yet: idle
    }
    ranked = rank_by_load(list(loads), list(loads.values()), [-1] * len(loads))
    assert [rank[0] for rank in ranked][:4] == ["idler", "new", "idle", "half"] or \
        [rank[0] for rank in ranked][:4] == ["new", "idler", "idle", "half"]
    assert [rank[0] for rank in ranked][4:] == ["behind", "full", "down"]
    # requests placed since the last report count: one more makes the half-busy replica full
    assert ReplicaLoad.from_stats(_report(busy=1), sent_since=1).full
    # equals go least recently chosen first, so requests routed at the same moment spread
    same = [ReplicaLoad.from_stats(_report())] * 3
    assert rank_by_load(["a", "b", "c"], same, [5, 2, 7])[0][0] == "b"
    assert [rank[0] for rank in rank_by_load(["a", "b", "c"], same, [5, -1, 7])] == ["b", "a", "c"]


@dataclass
class StandInReplica:
    """What `LoadAwareRouter` and Serve's `update_replicas` use of a `RunningReplica` (a real one wraps a
    live replica actor): its id, its last load report, and the queue-length probe Serve sends new ones."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any]

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


async def test_the_router_counts_requests_placed_since_a_report_until_they_end() -> None:
    deployment = DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP)
    router = LoadAwareRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    a = StandInReplica(ReplicaID("a", deployment), _report(busy=3, capacity=4, sessions=0))
    b = StandInReplica(ReplicaID("b", deployment), _report(busy=1, capacity=4, sessions=1))
    router.update_replicas([a, b])  # type: ignore[list-item]  # the stand-ins above
    replicas: list[Any] = [a, b]

    async def place(request_id: str) -> str:
        request = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id=request_id,
                                                                              internal_request_id=request_id))
        ranked = await router.choose_replicas(replicas, request)
        return str(ranked[0][0].replica_id.unique_id)

    # b reported 1 of 4 slots busy, a 3 of 4 (and fewer sessions): b takes two requests before its next
    # report, then counts 3 slots and 3 sessions, so a takes the next and is full
    assert [await place("r1"), await place("r2"), await place("r3")] == ["b", "b", "a"]
    router.on_request_completed(a.replica_id, "r3")  # Serve's hook: r3 ended before a's next report
    assert await place("r4") == "a"  # a's slot is free again at once: 3 of 4 and no sessions, before b
    router.on_request_completed(a.replica_id, "r4")
    router.on_request_completed(b.replica_id, "r1")
    assert await place("r5") == "b"  # b: 2 of 4 now, before a's 3 of 4
    b.routing_stats = {**_report(busy=3, capacity=4, sessions=3), "at": 2.0}  # b's next report counts r2, r5
    router.on_request_completed(b.replica_id, "r2")  # ended after b's report, which counts it: not taken off
    router.on_request_completed(b.replica_id, "never-placed")
    assert await place("r6") == "a"  # b's report stands (3 of 4, 3 sessions): a comes first


async def test_the_router_alternates_between_idle_replicas_for_requests_one_after_another() -> None:
    """Each request ends before the next is routed, so no load tells the replicas apart: they take turns."""
    deployment = DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP)
    router = LoadAwareRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    replicas: list[Any] = [StandInReplica(ReplicaID(name, deployment), _report(capacity=4)) for name in "ab"]
    router.update_replicas(replicas)
    chosen = []
    for i in range(6):
        request = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id=f"r{i}",
                                                                              internal_request_id=f"r{i}"))
        ranked = await router.choose_replicas(replicas, request)
        chosen.append(str(ranked[0][0].replica_id.unique_id))
        router.on_request_completed(ranked[0][0].replica_id, f"r{i}")
    assert chosen == ["a", "b"] * 3 or chosen == ["b", "a"] * 3


def test_the_committed_serve_config_builds_the_application(monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    config = yaml.safe_load((Path(__file__).parent.parent / "examples/ray/serve_config.yaml").read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "qwen3tts_agent.ray.app:app_builder"
    monkeypatch.setenv("QWEN3TTS_API_KEY", "from-the-environment")
    assert isinstance(app_builder(application["args"]), Application)
    settings = config_settings(application["args"])
    assert settings.server.api_key == "from-the-environment" and settings.server.host == "0.0.0.0"
    assert (settings.num_gpus, settings.num_replicas, settings.max_replicas) == (1, None, 8)
    monkeypatch.delenv("QWEN3TTS_API_KEY")
    with pytest.raises(ValueError, match="requires a bearer token"):  # 0.0.0.0 without a key is refused
        app_builder(application["args"])


def test_serve_ray_prints_a_config_that_builds_the_same_settings(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from qwen3tts_agent.cli import main

    def printed(*options: str) -> RayServeSettings:
        assert main(["serve-ray", "--model", "synthetic:tiny", "--num-gpus", "0", *options, "--print-config"]) == 0
        config = yaml.safe_load(capsys.readouterr().out)
        return RayServeSettings.from_dict(config["applications"][0]["args"])

    settings = printed("--max-replicas", "3", "--torch-threads", "1", "--max-sessions", "9", "--upscale-delay", "5",
                       "--downscale-delay", "60", "--look-back-period", "10", "--target-engine-load", "0.5")
    assert (settings.num_replicas, settings.max_replicas, settings.server.max_sessions) == (None, 3, 9)
    assert (settings.upscale_delay_s, settings.downscale_delay_s, settings.look_back_period_s) == (5, 60, 10)
    assert (settings.autoscale_on, settings.target_engine_load) == ("engine-load", 0.5)  # the default signal
    autoscaling = deployment_options(settings)["autoscaling_config"]
    assert (autoscaling["upscale_delay_s"], autoscaling["look_back_period_s"]) == (5, 10)
    # a window no longer than Serve's 10 s metric pushes gets pushes twice within it, which Serve accepts as is
    assert autoscaling["metrics_interval_s"] == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        AutoscalingConfig(**autoscaling)
    assert "metrics_interval_s" not in deployment_options(printed("--max-replicas", "3"))["autoscaling_config"]
    assert autoscaling["policy"] == {"policy_function": "qwen3tts_agent.ray.autoscaling:EngineLoadPolicy",
                                     "policy_kwargs": {"target_engine_load": 0.5}}
    assert "target_ongoing_requests" not in autoscaling

    ongoing = printed("--max-replicas", "2", "--autoscale-on", "ongoing-requests")
    assert (ongoing.autoscale_on, ongoing.target_ongoing_requests) == ("ongoing-requests", 16)
    autoscaling = deployment_options(ongoing)["autoscaling_config"]
    assert autoscaling["target_ongoing_requests"] == 16 and "policy" not in autoscaling  # Serve's default policy
    # a target of ongoing requests alone means that signal (command lines from before --autoscale-on); one of
    # the signal not chosen is ignored, with a note
    assert printed("--max-replicas", "2", "--target-ongoing-requests", "30").autoscale_on == "ongoing-requests"
    assert main(["serve-ray", "--model", "m", "--max-replicas", "2", "--num-gpus", "0", "--autoscale-on",
                 "engine-load", "--target-ongoing-requests", "30", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "--target-ongoing-requests is ignored with --autoscale-on engine-load" in err
    assert yaml.safe_load(out)["applications"][0]["args"]["autoscale_on"] == "engine-load"

    # the proxies' limits live in their environment, not in the config: printed as the line to export
    assert main(["serve-ray", "--model", "m", "--num-gpus", "0", "--print-config"]) == 0
    assert PROXY_LIMITS_ENV not in capsys.readouterr().err  # serve's defaults: nothing to export
    assert main(["serve-ray", "--model", "m", "--num-gpus", "0", "--send-timeout", "3", "--print-config"]) == 0
    exported = re.search(rf"export {PROXY_LIMITS_ENV}='([^']+)'", capsys.readouterr().err)
    assert exported is not None and json.loads(exported.group(1))["send_timeout_s"] == 3

    assert main(["serve-ray", "--model", "m", "--replicas", "0"]) == 2
    for refused in (["--target-engine-load", "0.5", "--target-ongoing-requests", "30"], ["--target-engine-load", "1.5"]):
        assert main(["serve-ray", "--model", "m", "--max-replicas", "2", "--num-gpus", "0", *refused,
                     "--print-config"]) == 2, refused
