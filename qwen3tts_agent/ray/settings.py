"""What one Serve application of engine replicas is made of: the model, the server's limits, and the scaling.

One frozen dataclass, handed to every replica as it is (Ray pickles it) and built from the `serve-ray`
options or from the `args` of a Serve config file (`from_dict`), so both start-ups mean the same thing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..server.config import ServerConfig, engine_tuning
from .autoscaling import DEFAULT_TARGET_ENGINE_LOAD, check_target

ENGINE_CORES = ("thread", "process")
AUTOSCALE_SIGNALS = ("engine-load", "ongoing-requests")
BACKENDS = ("auto", "torch", "int8", "int4", "fp32")


@dataclass(frozen=True)
class RayServeSettings:
    """Everything `build_app` needs.

    Args:
        model: hub id, local checkpoint folder or `synthetic:<spec>`, loaded by every replica.
        server: the server's limits and auth, as for `serve` (host and port are the Serve proxies').
        device, dtype: as for `serve`; a GPU replica sees only its own GPU, so "auto" means that one.
        max_streams: engine stream slots per replica ("auto": what the device holds).
        backend: what runs the model maths, as for `serve` ("auto": int8 ONNX Runtime on a CPU, PyTorch and
            the Triton kernels on a GPU; docs/cpu-backend.md).
        codec_hold_ms, step_period_ms, first_frame_step_load, clock_first_frame_load, shed_lateness_ms,
            chunk_schedule: the engine's scheduling, as `serve`'s options of those names (`--codec-hold-ms` and
            so on; docs/server.md); None: the engine's default. max_seq_len: positions a stream slot holds, as
            `serve --max-seq-len`; None: the engine's default.
        engine_core: "thread": the engine's step loop on a thread of the replica's process; "process": in
            a child process of the replica (`engine/process/supervisor.py`), so the step loop shares no interpreter lock
            with the replica's HTTP/WebSocket handling.
        torch_threads: torch's intra-op threads per replica (None: torch's default).
        num_replicas: a fixed number of replicas, or None to autoscale between `min_replicas` and
            `max_replicas` on `autoscale_on`.
        autoscale_on: what the autoscaler reads: "engine-load" (each replica's engine load, `autoscaling.
            engine_load`: utterances per synthesis slot, or sessions per session limit, 1 when the engine
            refuses; the policy `autoscaling.EngineLoadPolicy` keeps the replicas' mean at `target_engine_load`),
            or "ongoing-requests" (Serve's default policy: sessions and HTTP requests per replica, kept at
            `target_ongoing_requests`). From a Serve config's `args` that set `target_ongoing_requests` but
            not `autoscale_on`: "ongoing-requests", as before this setting existed (`from_dict`).
        target_engine_load: the engine-load policy's target of mean load per replica (0 to 1).
        target_ongoing_requests: the default policy's target of ongoing requests per replica.
        look_back_period_s: the window over which the autoscaler averages its signal (Serve's default); under
            20 s, the replicas push their metric to Serve's controller twice a window (`app.deployment_options`).
        upscale_delay_s, downscale_delay_s: how long the autoscaler's decision must hold before it adds or
            removes replicas (Serve's defaults).
        num_gpus, num_cpus: Ray resources each replica reserves (one GPU per engine on a GPU cluster). Below one
            GPU, replicas share a GPU and each engine's slots fit that share of its memory (`device_share`).
        max_ongoing_requests: Serve's cap on a replica's ongoing requests (None: room for every session
            and queued utterance the server's own limits allow, so those limits answer first, in their shape).
        max_queued_requests: requests a Serve proxy holds while every replica is at `max_ongoing_requests`;
            beyond it the proxy answers 503 `busy` (-1: no limit).
        health_check_period_s, health_check_timeout_s: Serve's health checks (`EngineReplica.check_health`).
        routing_stats_period_s: how often each replica's load (free slots, queue) reaches the routers.
        graceful_shutdown_timeout_s: how long a replica being stopped (scale-down, redeploy) waits for its
            sessions before they are cut.
        app_name, route_prefix: the Serve application's name and the path it serves under.
    """

    model: str
    server: ServerConfig = field(default_factory=ServerConfig)
    device: str = "auto"
    dtype: str = "auto"
    max_streams: int | str = "auto"
    backend: str = "auto"
    codec_hold_ms: float | None = None
    step_period_ms: float | None = None
    first_frame_step_load: int | None = None
    clock_first_frame_load: int | None = None
    shed_lateness_ms: float | None = None
    max_seq_len: int | None = None
    chunk_schedule: tuple[int, ...] | None = None
    engine_core: str = "thread"
    torch_threads: int | None = None
    num_replicas: int | None = 1
    min_replicas: int = 1
    max_replicas: int = 1
    autoscale_on: str = "engine-load"
    target_engine_load: float = DEFAULT_TARGET_ENGINE_LOAD
    target_ongoing_requests: float = 16.0
    look_back_period_s: float = 30.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    max_ongoing_requests: int | None = None
    max_queued_requests: int = 64
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    routing_stats_period_s: float = 0.5
    graceful_shutdown_timeout_s: float = 20.0
    app_name: str = "qwen3tts"
    route_prefix: str = "/"

    def validate(self) -> None:
        """Refuse what cannot run, with the option's name in the message (the server's own checks included)."""
        self.server.validate()
        if self.engine_core not in ENGINE_CORES:
            raise ValueError(f"engine_core must be one of {ENGINE_CORES}, got {self.engine_core!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        self.engine_kwargs()  # the scheduling options' own checks
        if self.max_streams != "auto" and (not isinstance(self.max_streams, int) or self.max_streams < 1):
            raise ValueError(f"max_streams must be a positive number or 'auto', got {self.max_streams!r}")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.num_replicas}")
        if self.num_replicas is None and not (0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1):
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got {self.min_replicas}..{self.max_replicas}"
            )
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, got {self.torch_threads}")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError("num_gpus and num_cpus must not be negative")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be at least 1, got {self.max_ongoing_requests}")
        if self.autoscale_on not in AUTOSCALE_SIGNALS:
            raise ValueError(f"autoscale_on must be one of {AUTOSCALE_SIGNALS}, got {self.autoscale_on!r}")
        check_target(self.target_engine_load)
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be positive, got {self.target_ongoing_requests}")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must not be negative")
        for name in ("health_check_period_s", "health_check_timeout_s", "routing_stats_period_s", "look_back_period_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def engine_kwargs(self) -> dict[str, Any]:
        """What each replica's engine is built with (`Engine.load`'s keyword arguments). Replicas below one GPU
        share it: Ray splits its compute, not its memory, so each engine's slots fit its share (`device_share`)."""
        kwargs: dict[str, Any] = {"max_streams": self.max_streams, "backend": self.backend}
        if 0.0 < self.num_gpus < 1.0:
            kwargs["device_share"] = self.num_gpus
        return {**kwargs, **engine_tuning(vars(self))}

    @property
    def replica_ongoing_limit(self) -> int:
        """Serve's per-replica cap: every session the server admits plus its queue of HTTP utterances, and
        room for the small requests (voices, metrics, readiness), so the server's limits bite first."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return self.server.max_sessions + self.server.max_queued + 64

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RayServeSettings:
        """From a Serve config's `args` (plain YAML values): unknown keys are refused by name. `args` that set
        `target_ongoing_requests` but not `autoscale_on` autoscale on ongoing requests, as they did before
        `autoscale_on` existed."""
        if "autoscale_on" not in values and "target_ongoing_requests" in values:
            values = {**values, "autoscale_on": "ongoing-requests"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown settings {unknown}; known: {sorted(known)}")
        server_values = dict(values.get("server") or {})
        server_known = {f.name for f in fields(ServerConfig)}
        bad = sorted(set(server_values) - server_known)
        if bad:
            raise ValueError(f"unknown server settings {bad}; known: {sorted(server_known)}")
        for key in ("voices_dir", "default_voice_audio"):
            if server_values.get(key) is not None:
                server_values[key] = Path(server_values[key]).expanduser()
        server_values.setdefault("model_name", values.get("model", "qwen3-tts"))
        if values.get("chunk_schedule") is not None:  # a YAML list
            values = {**values, "chunk_schedule": tuple(values["chunk_schedule"])}
        return cls(**{**values, "server": ServerConfig(**server_values)})

    def to_dict(self) -> dict[str, Any]:
        """The inverse of `from_dict` (paths as strings), e.g. to write a Serve config."""
        values = asdict(self)
        values["server"] = {k: str(v) if isinstance(v, Path) else v for k, v in values["server"].items()}
        if self.chunk_schedule is not None:  # YAML has no tuples
            values["chunk_schedule"] = list(self.chunk_schedule)
        return values
