"""One engine replica: the server's own app (`create_app`) around one engine, as a Ray Serve ingress.

Serve runs this class as an actor per replica (one GPU each on a GPU cluster) and relays every HTTP
request and WebSocket connection to the app built here, so auth, limits, error shapes and the
protocol are exactly `serve`'s. A WebSocket session is one ongoing request of one replica for its whole
life: its engine streams never move. On top of the app, the replica

- becomes routable only once its engine is loaded and warmed up (the app's start-up runs inside Serve's
  replica start, which waits for readiness and fails, so Serve retries, if loading failed);
- reports its load to the routers (`record_routing_stats`, read by `router.LoadAwareRouter`) and to Serve's
  autoscaler (`record_autoscaling_stats`: its engine load, read by `autoscaling.EngineLoadPolicy`);
- fails Serve's health check while its engine is down or failed, so Serve replaces the replica (the
  engine's own restarts of a dead core come first: Serve acts after three failed checks in a row);
- names itself in an `x-qwen3tts-replica` response header (HTTP responses and WebSocket handshakes);
- sends its metrics to the application's `MetricsHub` and answers `/metrics` for all replicas;
- lists the replicas' own endpoints at `GET /v1/replicas` (with Serve's direct ingress: `direct.py`);
- under direct ingress, serves its own port with `serve`'s connection protocols and limits (`transport.py`): no
  permessage-deflate (compressing there delayed first audio under load), deadlines for request
  heads and unread responses, bounded buffers and frames.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..server.app import create_app
from ..server.protocol import ApiError
from ..server.state import ServerState
from .autoscaling import ENGINE_LOAD_METRIC, LoadMeter, engine_load
from .direct import direct_ingress
from .metrics import PUSH_INTERVAL_S, merge, render
from .settings import RayServeSettings
from .transport import bound_connections

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-qwen3tts-replica"
READY_POLL_S = 0.1


class _ReplicaHeader:
    """Adds `x-qwen3tts-replica: <id>` to every HTTP response and WebSocket handshake of this replica."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self._header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_header(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept", "websocket.http.response.start"):
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] != "lifespan" else send)


class EngineReplica:
    """The Serve deployment class (wrapped by `serve.ingress()` in `app.build_app`)."""

    def __init__(self, settings: RayServeSettings, metrics_hub: Any) -> None:
        bound_connections(settings.server)  # before Serve starts this replica's direct-ingress server
        self._settings = settings
        self._hub = metrics_hub  # a DeploymentHandle of metrics.MetricsHub
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self._deployment_id = context.replica_id.deployment_id  # app name as deployed (a config may rename it)
        if settings.torch_threads is not None:
            import torch

            torch.set_num_threads(settings.torch_threads)
        self._core: Any = None  # engine.process.EngineProcess with engine_core="process"
        self._state: ServerState | None = None
        self._pusher: asyncio.Task[None] | None = None
        self._load = LoadMeter()  # engine load sampled at each routing-stats poll, averaged for the autoscaler

    # ------------------------------------------------------------------ the app
    def __serve_build_asgi_app__(self) -> ASGIApp:
        """Called by Serve after `__init__`: the server's app, its start-up extended to wait for readiness."""
        app = create_app(self._settings.server, engine_factory=self._load_engine)
        self._state = state = app.state.server
        serve_lifespan = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(fastapi_app: Any) -> AsyncIterator[None]:
            try:
                async with serve_lifespan(fastapi_app):
                    await self._until_ready(state)
                    self._pusher = asyncio.create_task(self._push_metrics(state), name="qwen3tts-metrics-push")
                    try:
                        yield
                    finally:
                        self._pusher.cancel()
                        await self._leave_hub()
            finally:
                if self._core is not None:
                    await asyncio.to_thread(self._core.stop)

        app.router.lifespan_context = lifespan
        self._serve_all_metrics(app, state)
        self._serve_replica_list(app, state)
        app.add_middleware(_ReplicaHeader, replica=self.replica)
        return app

    def _load_engine(self) -> Any:
        """The app's engine factory (run on a worker thread by the app's start-up)."""
        s = self._settings
        engine_kwargs = s.engine_kwargs()
        if s.engine_core == "thread":
            from ..engine.frontend import Engine

            return Engine.load(s.model, device=s.device, dtype=s.dtype, progress=False, **engine_kwargs)
        from ..engine.process import CoreLaunch, EngineClient, EngineProcess, fresh_core_address

        address = fresh_core_address("qwen3tts-ray")
        self._core = EngineProcess(CoreLaunch(
            s.model, address, device=s.device, dtype=s.dtype, engine_kwargs=engine_kwargs,
            warmup=s.server.warmup, log_level="WARNING",
        ))
        self._core.start(wait=True)
        return EngineClient.connect(address, timeout=None)

    @staticmethod
    async def _until_ready(state: ServerState) -> None:
        """Hold Serve's replica start until the engine is loaded and warmed up; raise if that failed."""
        while not state.ready:
            if state.failure is not None:
                raise RuntimeError(f"the engine failed to start: {state.failure}")
            await asyncio.sleep(READY_POLL_S)

    # ------------------------------------------------------------------ Serve's hooks
    def check_health(self) -> None:
        """Serve's health check: raises while the engine is failed or down (Serve replaces the replica
        after three failures in a row)."""
        state = self._state
        if state is None or state.failure is not None:
            raise RuntimeError(f"the engine failed: {state.failure if state else 'no app'}")
        if self._core is not None and self._core.failure is not None:
            raise RuntimeError(f"the engine-core process failed: {self._core.failure}")
        if not state.engine.healthy:
            raise RuntimeError("the engine core is down")

    def record_routing_stats(self) -> dict[str, Any]:
        """This replica's load, for `router.LoadAwareRouter` (pulled by Serve every routing_stats_period_s);
        each poll is also a sample of the engine load reported to the autoscaler."""
        stats = self._current_load()
        self._load.observe(self._engine_load(stats), time.monotonic())
        return stats

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric, read by `autoscaling.EngineLoadPolicy`: this replica's engine load
        (`autoscaling.engine_load`), averaged over the time since Serve last asked (`autoscaling.LoadMeter`).
        Serve calls it every look_back_period_s / 5 (at most 10 s) once the deployment autoscales."""
        load = self._engine_load(self._current_load())
        return {ENGINE_LOAD_METRIC: self._load.take(load, time.monotonic())}

    def _current_load(self) -> dict[str, Any]:
        state = self._state
        if state is None or not state.ready:
            return {"at": time.time(), "ready": False, "healthy": False, "overloaded": False,
                    "capacity": 0, "busy": 0, "sessions": 0, "max_sessions": 0}
        stats = state.engine.stats()
        admission = state.admission
        assert admission is not None  # set before ready
        return {
            "at": time.time(),
            "ready": True,
            "healthy": stats.healthy,
            "overloaded": stats.overloaded,
            "capacity": admission.capacity,
            "busy": stats.active_streams + stats.queued_streams + admission.waiting,
            "sessions": state.sessions,
            "max_sessions": state.config.max_sessions,
        }

    @staticmethod
    def _engine_load(stats: dict[str, Any]) -> float:
        return engine_load(
            busy=stats["busy"], capacity=stats["capacity"], sessions=stats["sessions"],
            max_sessions=stats["max_sessions"], overloaded=stats["overloaded"],
            available=stats["ready"] and stats["healthy"],
        )

    # ------------------------------------------------------------------ metrics
    async def _push_metrics(self, state: ServerState) -> None:
        while True:
            try:
                await self._hub.report.remote(self.replica, list(state.metrics.registry.collect()))
            except Exception as exc:  # noqa: BLE001 - the hub restarting must not stop the replica
                logger.warning("metrics push failed: %s", exc)
            await asyncio.sleep(PUSH_INTERVAL_S)

    async def _leave_hub(self) -> None:
        """A replica stopping (scale-down, redeploy) leaves the summed metrics at once, not 5 s later."""
        try:
            await self._hub.forget.remote(self.replica)
        except Exception as exc:  # noqa: BLE001 - the hub may be stopping too
            logger.info("could not leave the metrics hub: %s", exc)

    def _serve_all_metrics(self, app: FastAPI, state: ServerState) -> None:
        """Replace the app's `/metrics` (this replica only) with every replica's: summed, and per replica."""

        async def collect(request: Request, per_replica: bool) -> Response:
            state.authorize(request.headers.get("authorization"))
            snapshots = await self._hub.snapshots.remote()
            snapshots[self.replica] = list(state.metrics.registry.collect())  # live, not the last push
            return Response(render(merge(snapshots, per_replica=per_replica)), media_type=CONTENT_TYPE_LATEST)

        async def summed(request: Request) -> Response:
            return await collect(request, per_replica=False)

        async def per_replica(request: Request) -> Response:
            return await collect(request, per_replica=True)

        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/metrics"]
        app.router.routes.insert(0, Route("/metrics", summed, methods=["GET"]))
        app.router.routes.insert(1, Route("/metrics/replicas", per_replica, methods=["GET"]))

    def _serve_replica_list(self, app: FastAPI, state: ServerState) -> None:
        """`GET /v1/replicas` (bearer token): every running replica's own endpoint when the cluster runs Serve's
        direct ingress (`direct.direct_ingress`), for load balancers and clients that spread sessions over them;
        `{"direct_ingress": false, "replicas": []}` without it; 500 `internal_error` if the controller could not
        be asked. One call to Serve's controller per request."""

        async def replicas(request: Request) -> Response:
            state.authorize(request.headers.get("authorization"))
            found = await asyncio.to_thread(direct_ingress, self._deployment_id.app_name, self._deployment_id.name)
            if found.enabled is None:
                raise ApiError("internal_error", f"could not ask Serve's controller for the replicas: {found.error}")
            return JSONResponse(found.to_dict())

        app.router.routes.insert(0, Route("/v1/replicas", replicas, methods=["GET"]))
