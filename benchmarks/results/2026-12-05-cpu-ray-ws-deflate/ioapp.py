"""The diagnosis's server: a WebSocket app with the TTS session's message pattern and no model.

On `flush` it waits FIRST_MS, then sends one 80 ms chunk (a JSON header and 3,840 bytes of PCM) every 80 ms, doing
BURN_US of Python work per chunk (the app's own share of a core). Run under plain uvicorn (`uvicorn PORT`,
`uvicorn-deflate PORT`) or as a Ray Serve replica (`serve PORT`; direct ingress from the environment); with
FIX=1 the replica declines permessage-deflate as `EngineReplica` does (qwen3tts_agent/ray/transport.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import numpy as np
from fastapi import FastAPI, WebSocket

FIRST_MS = 5.0
BURN_S = float(os.environ.get("BURN_US", "0")) / 1e6
PCM = (np.random.default_rng(0).standard_normal(1920) * 3000).astype("<i2").tobytes()


def burn() -> None:
    end = time.perf_counter() + BURN_S
    while time.perf_counter() < end:
        pass


def make_app() -> FastAPI:
    app = FastAPI()

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket) -> None:
        await ws.accept()
        while True:
            msg = json.loads(await ws.receive_text())
            if msg["type"] == "close":
                await ws.close()
                return
            if msg["type"] != "flush":
                continue
            seen = time.monotonic()
            frames = msg.get("frames", 100)
            await asyncio.sleep(FIRST_MS / 1000)
            start = first_sent = time.monotonic()
            for i in range(frames):
                burn()
                await ws.send_text(json.dumps({"type": "audio", "seq": i, "samples": 1920, "is_last": i == frames - 1}))
                await ws.send_bytes(PCM)
                if i == 0:
                    first_sent = time.monotonic()
                await asyncio.sleep(max(0.0, start + 0.08 * (i + 1) - time.monotonic()))
            await ws.send_text(json.dumps({"type": "done", "seen": seen, "first_sent": first_sent}))

    return app


def serve_replica(port: int) -> None:
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    @serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=2000)
    @serve.ingress(make_app())
    class IO:
        def __init__(self) -> None:
            if os.environ.get("FIX") == "1":
                from qwen3tts_agent.ray.transport import bound_connections
                from qwen3tts_agent.server.config import ServerConfig

                bound_connections(ServerConfig())  # what a replica does (declines compression, among its bounds)

    serve.run(IO.bind(), name="io", route_prefix="/")  # type: ignore[attr-defined]
    print("READY", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode.startswith("uvicorn"):
        import uvicorn

        uvicorn.run(make_app(), host="127.0.0.1", port=port, log_level="warning",
                    ws_per_message_deflate=mode == "uvicorn-deflate")
    else:
        serve_replica(port)
