"""Scale-out on Ray Serve: many engine replicas (one per GPU) behind one WebSocket/HTTP endpoint.

Needs the `[ray]` extra. See docs/ray.md; the pieces: `settings.RayServeSettings`, `app.build_app`
(the Serve application), `replica.EngineReplica` (one engine and the server's app), `router.LoadAwareRouter`
(new sessions to the least loaded replica), `autoscaling` (replicas added and removed on the engines' load),
`metrics` (every replica's metrics through one endpoint), `proxy` (the server's error shapes where Serve's
proxy answers), `direct` (Serve's direct ingress: each replica's own port, listed), `cli` (`qwen3tts-agent serve-ray`).
"""

from .settings import RayServeSettings

__all__ = ["RayServeSettings"]
