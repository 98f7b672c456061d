"""`serve-ray --direct-ingress`: each engine replica serves a port of its own beside Serve's proxy.

Serve reads `RAY_SERVE_ENABLE_DIRECT_INGRESS` once, when each of its processes starts, so the cluster must be
started with it: here `serve-ray --direct-ingress` itself, as a child process that starts its own Ray instance
(two replicas of the tiny engine, engine cores on threads), one for the whole module. The pytest process never
joins it, and the last test stops it with Ctrl-C, so this module's cluster is gone before another module's
starts (tests/test_ray_serve.py starts one in-process). Real parts throughout: Ray, Serve, the replicas' own
servers, `websockets`/`httpx` clients and `benchmarks/serving/load.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from uvicorn.server import ServerState

from qwen3tts_agent.ray.cli import direct_ingress_problem
from qwen3tts_agent.ray.direct import DIRECT_INGRESS_ENV, DirectEndpoint, DirectIngress, target_endpoints
from qwen3tts_agent.ray.proxy import proxy_middlewares
from qwen3tts_agent.ray.replica import REPLICA_HEADER
from qwen3tts_agent.ray.transport import (
    PROXY_LIMITS_ENV,
    LimitedHttpProtocol,
    LimitedWebSocketProtocol,
    ProxyWebSocketProtocol,
    bound_connections,
    bound_proxy_connections,
    proxy_limits_environment,
)
from qwen3tts_agent.server.config import ServerConfig
from tests.ray_session import Session, answer_to_half_a_head

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "direct-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SLOTS = 2  # synthesis slots per replica (--max-active-streams), no queue: a full replica answers `busy` at once
START_TIMEOUT_S = 150.0
STOP_BOUND_S = 30.0  # idle: the local draining period (5 s), Serve's shutdown and Ray's
READ_TIMEOUT_S = 1.0  # --http-read-timeout: a request head must arrive within this long
ENDPOINT_LINE = re.compile(r"^replica (\S+) of \S+: direct endpoint (ws://\S+) ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Deployment:
    """The `serve-ray` child process, its proxy's address and the endpoints it printed (replica id -> ws URL)."""

    process: subprocess.Popen[str]
    proxy: str  # host:port
    printed: dict[str, str]
    output: list[str] = field(default_factory=list)

    def http(self, replica: str) -> str:
        return self.printed[replica].replace("ws://", "http://")


def session_processes(session: int) -> list[int]:
    """Processes of a session (`serve-ray` started with start_new_session: it, its Ray instance and the Ray
    workers, which leave its process group but not its session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # after the name: state, ppid, pgrp, session
            found.append(int(entry.name))
    return found


def stop_everything(session: int) -> None:
    """Never leave a Ray instance behind: SIGKILL what is left of the session."""
    for pid in session_processes(session):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _read_lines(process: subprocess.Popen[str], lines: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    port = free_port()
    command = [
        sys.executable, "-m", "qwen3tts_agent.cli", "serve-ray", "--model", "synthetic:tiny", "--direct-ingress",
        "--replicas", "2", "--num-gpus", "0", "--num-cpus", "0.5", "--torch-threads", "1", "--engine-core", "thread",
        "--ray-num-cpus", "2", "--port", str(port), "--api-key", API_KEY, "--max-streams", "4",
        "--max-active-streams", str(SLOTS), "--max-queued", "0", "--max-frames", "2000",
        "--voices-dir", str(tmp_path_factory.mktemp("voices")), "--health-check-period", "0.5",
        "--routing-stats-period", "0.2", "--http-read-timeout", str(READ_TIMEOUT_S), "--log-level", "warning",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}  # serve-ray sets its own
    env["OMP_NUM_THREADS"] = "1"
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # its Ray processes share its process group
    lines: list[str] = []
    threading.Thread(target=_read_lines, args=(process, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(line.startswith("direct ingress:") for line in lines):
            assert process.poll() is None, "serve-ray exited:\n" + "\n".join(lines[-40:])
            assert time.monotonic() < deadline, "serve-ray did not list its endpoints:\n" + "\n".join(lines[-40:])
            time.sleep(0.2)
        printed = {m.group(1): m.group(2) for m in map(ENDPOINT_LINE.match, lines) if m}
        yield Deployment(process, f"127.0.0.1:{port}", printed, lines)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_BOUND_S + 30)
        stop_everything(process.pid)
        process.wait(30)



def utterances_per_replica(proxy: str) -> dict[str, float]:
    """WebSocket utterances each replica has finished, from `/metrics/replicas` (through the proxy)."""
    text = httpx.get(f"http://{proxy}/metrics/replicas", headers=AUTH, timeout=30).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "qwen3tts_utterances_total" and sample.labels.get("endpoint") == "ws":
                replica = sample.labels["replica"]
                totals[replica] = totals.get(replica, 0.0) + sample.value
    return totals


def replicas_in_metrics(proxy: str, timeout: float = 10.0) -> set[str]:
    """The replica ids `/metrics/replicas` names, once both have pushed their metrics."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"http://{proxy}/metrics/replicas", headers=AUTH, timeout=30).text
        names = set(re.findall(r'replica="([^"]+)"', text))
        if len(names) == 2 or time.monotonic() > deadline:
            return names
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------- without a cluster
def test_joining_a_cluster_without_direct_ingress_is_refused_and_an_unknown_one_warned() -> None:
    assert direct_ingress_problem(asked=False, local=False, enabled=False) == (None, None)
    assert direct_ingress_problem(asked=True, local=False, enabled=True) == (None, None)
    error, warning = direct_ingress_problem(asked=True, local=False, enabled=False)
    assert warning is None and error is not None and f"{DIRECT_INGRESS_ENV}=1 ray start" in error
    error, warning = direct_ingress_problem(asked=True, local=True, enabled=False)
    assert error is not None and warning is None
    error, warning = direct_ingress_problem(asked=True, local=False, enabled=None)
    assert error is None and warning is not None and "could not confirm" in warning


def test_a_direct_endpoints_urls() -> None:
    assert DirectEndpoint("r1", "10.0.0.5", 30001).ws == "ws://10.0.0.5:30001"
    assert DirectEndpoint("r1", "10.0.0.5", 30001, "/tts/").http == "http://10.0.0.5:30001/tts"
    assert DirectEndpoint("r1", "fd00::5", 30002).ws == "ws://[fd00::5]:30002"
    body = DirectIngress(enabled=True, endpoints=[DirectEndpoint("r1", "127.0.0.1", 30000)]).to_dict()
    assert body == {"direct_ingress": True, "replicas": [
        {"replica": "r1", "ws": "ws://127.0.0.1:30000", "http": "http://127.0.0.1:30000", "host": "127.0.0.1",
         "port": 30000}]}


def test_the_endpoints_are_the_deployments_replicas_among_serves_target_groups() -> None:
    """Serve's own target groups (`ray.serve.schema`): the proxies Serve lists for an application without a running
    replica, other applications and other deployments are left out; a wildcard bind host becomes the node's IP."""
    from ray.serve._private.common import RequestProtocol
    from ray.serve.schema import Target, TargetGroup

    def target(name: str, port: int) -> Target:
        return Target(ip="10.0.0.7", port=port, instance_id="", name=name)

    groups = [
        TargetGroup(protocol=RequestProtocol.HTTP, route_prefix="/", app_name="qwen3tts", targets=[
            target("SERVE_REPLICA::qwen3tts#EngineReplica#bbb", 30001),
            target("SERVE_REPLICA::qwen3tts#EngineReplica#aaa", 30000),
            target("SERVE_PROXY_ACTOR-node", 8000),
        ]),
        TargetGroup(protocol=RequestProtocol.HTTP, route_prefix="/other", app_name="other", targets=[
            target("SERVE_REPLICA::other#EngineReplica#ccc", 30002)]),
        TargetGroup(protocol=RequestProtocol.GRPC, route_prefix="/", app_name="qwen3tts", targets=[
            target("SERVE_REPLICA::qwen3tts#EngineReplica#aaa", 40000)]),
    ]
    assert [(e.replica, e.ws) for e in target_endpoints(groups, "0.0.0.0", "qwen3tts", "EngineReplica")] == [
        ("aaa", "ws://10.0.0.7:30000"), ("bbb", "ws://10.0.0.7:30001")]
    assert [e.ws for e in target_endpoints(groups, "127.0.0.1", "qwen3tts", "EngineReplica")] == [
        "ws://127.0.0.1:30000", "ws://127.0.0.1:30001"]
    assert target_endpoints(groups, "127.0.0.1", "qwen3tts", "MetricsHub") == []


def test_print_config_says_direct_ingress_is_the_clusters(capsys: pytest.CaptureFixture[str]) -> None:
    from qwen3tts_agent.cli import main

    assert main(["serve-ray", "--model", "synthetic:tiny", "--num-gpus", "0", "--direct-ingress", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert f"export {DIRECT_INGRESS_ENV}=1" in err and "direct" not in out  # the config file cannot carry it


async def test_a_proxy_gets_serves_connection_protocols_with_the_limits_serve_ray_gave_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the proxy's middleware callback does to its process before Serve starts its server there: uvicorn
    configured as Serve configures it (`http` and `ws` left "auto", permessage-deflate on) gets `serve`'s bounded
    protocols with the limits `serve-ray` put in the environment (`ServerConfig`'s defaults without them), a
    WebSocket that offers no extension, and the server's own config left as it was; a malformed variable stops
    the proxy with its name rather than leave it unbounded."""
    for table in (uvicorn.config.HTTP_PROTOCOLS, uvicorn.config.WS_PROTOCOLS):
        monkeypatch.setitem(table, "auto", table["auto"])  # restored after

    async def app(scope: object, receive: object, send: object) -> None:
        pass

    def loaded() -> uvicorn.Config:
        config = uvicorn.Config(app, lifespan="off", log_config=None)
        config.load()
        return config

    monkeypatch.setenv(*next(iter(proxy_limits_environment(ServerConfig(http_read_timeout_s=2.0, send_timeout_s=3.0,
                                                                        max_message_bytes=1000)).items())))
    proxy_middlewares()
    config = loaded()
    assert config.http_protocol_class is LimitedHttpProtocol and config.ws_protocol_class is ProxyWebSocketProtocol
    http = LimitedHttpProtocol(config=config, server_state=ServerState(), app_state={})
    assert http.limits.read_timeout_s == 2.0 and http.limits.send_timeout_s == 3.0
    ws = ProxyWebSocketProtocol(config=config, server_state=ServerState(), app_state={})
    assert ws.conn.available_extensions == [] and ws.conn.max_message_size == 2000 and ws.close_timeout == 3.0
    assert config.ws_per_message_deflate  # the server's own config as Serve set it

    monkeypatch.delenv(PROXY_LIMITS_ENV)
    bound_proxy_connections()
    http = LimitedHttpProtocol(config=loaded(), server_state=ServerState(), app_state={})
    assert http.limits.read_timeout_s == ServerConfig().http_read_timeout_s
    for bad in ("not json", '{"send_timeout": 1}', "[1]"):
        monkeypatch.setenv(PROXY_LIMITS_ENV, bad)
        with pytest.raises(ValueError, match=PROXY_LIMITS_ENV):
            bound_proxy_connections()


async def test_a_replicas_port_gets_serves_connection_protocols_with_its_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a replica does to its process before Serve starts its direct-ingress server: uvicorn configured as Serve
    configures it (`http` and `ws` left "auto") gets `serve`'s bounded protocols, with the replica's limits."""
    for table in (uvicorn.config.HTTP_PROTOCOLS, uvicorn.config.WS_PROTOCOLS):
        monkeypatch.setitem(table, "auto", table["auto"])  # restored after

    async def app(scope: object, receive: object, send: object) -> None:
        pass

    bound_connections(ServerConfig(max_message_bytes=1000, send_timeout_s=3.0, http_read_timeout_s=2.0))
    config = uvicorn.Config(app, lifespan="off", log_config=None)
    config.load()
    assert config.http_protocol_class is LimitedHttpProtocol and config.ws_protocol_class is LimitedWebSocketProtocol
    http = LimitedHttpProtocol(config=config, server_state=ServerState(), app_state={})
    assert http.limits.read_timeout_s == 2.0 and http.limits.send_timeout_s == 3.0
    ws = LimitedWebSocketProtocol(config=config, server_state=ServerState(), app_state={})
    assert ws.conn.available_extensions == [] and ws.conn.max_message_size == 2000 and ws.close_timeout == 3.0
    assert config.ws_per_message_deflate and config.ws_max_size != 2000  # the server's own config as Serve set it


# ---------------------------------------------------------------------------------------------- on the cluster
def test_serve_ray_lists_each_replicas_own_endpoint(deployment: Deployment) -> None:
    printed = deployment.printed
    assert len(printed) == 2 and len(set(printed.values())) == 2, deployment.output[-20:]
    # the list the app serves (through the proxy and on each replica's own port) is the one printed
    listed = httpx.get(f"http://{deployment.proxy}/v1/replicas", headers=AUTH, timeout=30).json()
    assert listed["direct_ingress"] is True
    assert {r["replica"]: r["ws"] for r in listed["replicas"]} == printed
    for replica in printed:
        on_its_port = httpx.get(f"{deployment.http(replica)}/v1/replicas", headers=AUTH, timeout=30)
        assert on_its_port.json() == listed and on_its_port.headers[REPLICA_HEADER] == replica
        # each port is that replica's, and the engine behind it is ready
        ready = httpx.get(f"{deployment.http(replica)}/ready", timeout=10)
        assert ready.status_code == 200 and ready.headers[REPLICA_HEADER] == replica
        assert httpx.get(f"{deployment.http(replica)}/-/healthz", timeout=10).text == "success"  # Serve's, for LBs
    assert replicas_in_metrics(deployment.proxy) == set(printed)  # exactly the application's replicas
    assert httpx.get(f"http://{deployment.proxy}/v1/replicas", timeout=10).status_code == 401


async def test_each_direct_endpoint_serves_its_replicas_websocket_sessions_and_openai_speech(
    deployment: Deployment,
) -> None:
    body = {"model": "tts-1", "input": "Hello there!", "voice": "alloy", "response_format": "pcm",
            "sampling": {"max_frames": 5, "ignore_eos": True, "seed": 3}}
    for replica, url in deployment.printed.items():
        session = await Session.open(url, AUTH, max_frames=6)
        try:
            assert session.replica == replica  # a session on a replica's port lands on that replica
            for _ in range(2):  # and so does every utterance of it
                await session.say("Hello there, how can I help?")
                _, first_pcm = await session.until("audio")
                done, pcm = await session.until("done")
                assert done["finish_reason"] == "max_frames" and first_pcm + pcm == 6 * 1920 * 2
        finally:
            await session.ws.close()
        async with httpx.AsyncClient(base_url=deployment.http(replica), timeout=60) as client:
            speech = await client.post("/v1/audio/speech", json=body, headers=AUTH)
            assert speech.status_code == 200 and len(speech.content) == 5 * 1920 * 2
            assert speech.headers[REPLICA_HEADER] == replica
            refused = await client.post("/v1/audio/speech", json=body)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"


async def test_a_full_replica_answers_busy_on_its_own_port_while_the_other_is_free(deployment: Deployment) -> None:
    """No router on a replica's port: a full replica refuses there, whatever the other's load."""
    full, free = sorted(deployment.printed)
    held: list[Session] = []
    try:
        for _ in range(SLOTS):  # unflushed text holds a synthesis slot until the flush
            s = await Session.open(deployment.printed[full], AUTH, max_frames=4)
            await s.say("Hold this slot", flush=False)
            held.append(s)
        extra = await Session.open(deployment.printed[full], AUTH, max_frames=4)
        await extra.say("No room left here")
        error, _ = await extra.until("error")
        assert (error["code"], error["status"]) == ("busy", 503)
        await extra.ws.close()
        elsewhere = await Session.open(deployment.printed[free], AUTH, max_frames=4)
        await elsewhere.say("Plenty of room here")
        done, pcm = await elsewhere.until("done")
        assert elsewhere.replica == free and done["finish_reason"] == "max_frames" and pcm > 0
        await elsewhere.ws.close()
        for s in held:
            await s.ws.send(json.dumps({"type": "flush"}))
            done, pcm = await s.until("done")
            assert done["finish_reason"] == "max_frames" and pcm > 0
    finally:
        await asyncio.gather(*(s.ws.close() for s in held))


async def test_the_direct_ports_and_the_proxy_send_audio_uncompressed(deployment: Deployment) -> None:
    """Offered permessage-deflate (as browsers and the `websockets` client offer it), a replica's own port and the
    proxy decline it, as `serve` does. Serve starts their uvicorn servers with it on; accepted, every audio message
    was compressed on the replica's main event loop, a thread away from the app's, and under load the first audio
    of a session came tens of ms late (qwen3tts_agent/ray/transport.py)."""
    for url in [*deployment.printed.values(), f"ws://{deployment.proxy}"]:
        session = await Session.open(url, AUTH, max_frames=3)
        try:
            request, response = session.ws.request, session.ws.response
            assert request is not None and "permessage-deflate" in request.headers["Sec-WebSocket-Extensions"]
            assert response is not None and "Sec-WebSocket-Extensions" not in response.headers, url
            assert session.ws.protocol.extensions == []
            await session.say("Plain audio frames.")
            done, pcm = await session.until("done")
            assert done["finish_reason"] == "max_frames" and pcm == 3 * 1920 * 2
        finally:
            await session.close()


def test_a_replicas_port_closes_a_request_head_that_never_ends(deployment: Deployment) -> None:
    """Stock uvicorn keeps a connection that sends half a request head for good; a replica's own port answers 408
    and closes after `--http-read-timeout`, as `serve` does."""
    for url in deployment.printed.values():
        host, port = url.removeprefix("ws://").split(":")
        answer, seconds = answer_to_half_a_head(host, int(port), READ_TIMEOUT_S + 10)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:200]
        assert seconds < READ_TIMEOUT_S + 3


async def test_the_proxy_still_serves_beside_the_direct_ports(deployment: Deployment) -> None:
    seen = set()
    for _ in range(2):
        session = await Session.open(f"ws://{deployment.proxy}", AUTH, max_frames=4)
        await session.say("Through the proxy.")
        done, pcm = await session.until("done")
        assert done["finish_reason"] == "max_frames" and pcm == 4 * 1920 * 2
        seen.add(session.replica)
        await session.ws.close()
    assert seen <= set(deployment.printed)


def test_the_load_benchmark_spreads_its_clients_over_the_direct_endpoints(
    deployment: Deployment, tmp_path: Path
) -> None:
    before = utterances_per_replica(deployment.proxy)
    out = tmp_path / "load.json"
    command = [
        sys.executable, "-m", "benchmarks.serving.load", "--model", "synthetic:tiny",
        "--url", f"ws://{deployment.proxy}", "--client-urls", *sorted(deployment.printed.values()),
        "--api-key", API_KEY, "--rates", "2", "--duration", "2", "--warmup", "1", "--frames", "4", "--clients", "2",
        "--out", str(out),
    ]
    subprocess.run(command, cwd=ROOT, check=True, timeout=180, capture_output=True, text=True)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["transport"] == "ws" and run["completed"] > 0 and not run["errors"], run
    time.sleep(1.5)  # a push of each replica's metrics
    after = utterances_per_replica(deployment.proxy)
    grew = {replica: after.get(replica, 0.0) - before.get(replica, 0.0) for replica in deployment.printed}
    assert all(n > 0 for n in grew.values()), grew  # each client process on its own replica's port


def test_serve_ray_stops_on_ctrl_c_within_a_bound(deployment: Deployment) -> None:
    """Runs last: stops the module's deployment. Idle, it waits for the replicas' draining period (5 s for a Ray
    instance serve-ray starts) and Serve's and Ray's shutdown, never Ray's default 30 s drain of direct ingress."""
    started = time.monotonic()
    deployment.process.send_signal(signal.SIGINT)
    assert deployment.process.wait(STOP_BOUND_S + 30) == 0
    took = time.monotonic() - started
    assert took < STOP_BOUND_S, f"serve-ray took {took:.1f} s to stop"
    for url in deployment.printed.values():  # the replicas' ports are closed
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("ws://", "http://") + "/ready", timeout=5)
    deadline = time.monotonic() + 15
    while session_processes(deployment.process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert session_processes(deployment.process.pid) == []  # the Ray instance went with it (workers included)
