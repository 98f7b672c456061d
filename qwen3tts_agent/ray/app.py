"""The Serve application: engine replicas behind Serve's proxies, with a metrics hub beside them.

`build_app(settings)` returns the application for `serve.run`; `app_builder` is the same for a Serve
config file (`import_path: qwen3tts_agent.ray.app:app_builder`, the settings as `args`).
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import DEFAULT_METRICS_INTERVAL_S

from .autoscaling import POLICY
from .metrics import MetricsHub
from .replica import EngineReplica
from .settings import RayServeSettings

ROUTER_CLASS = "qwen3tts_agent.ray.router:LoadAwareRouter"
ENGINE_DEPLOYMENT = "EngineReplica"
METRICS_DEPLOYMENT = "MetricsHub"
API_KEY_ENV = "QWEN3TTS_API_KEY"


def deployment_options(settings: RayServeSettings) -> dict[str, Any]:
    """`serve.deployment` options of the engine replicas (see RayServeSettings for each)."""
    options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": settings.num_cpus, "num_gpus": settings.num_gpus},
        "max_ongoing_requests": settings.replica_ongoing_limit,
        "max_queued_requests": settings.max_queued_requests,
        "health_check_period_s": settings.health_check_period_s,
        "health_check_timeout_s": settings.health_check_timeout_s,
        "graceful_shutdown_timeout_s": settings.graceful_shutdown_timeout_s,
        "request_router_config": {  # ray.serve.config.RequestRouterConfig's fields
            "request_router_class": ROUTER_CLASS,
            "request_routing_stats_period_s": settings.routing_stats_period_s,
            "request_routing_stats_timeout_s": max(5.0, 10 * settings.routing_stats_period_s),
        },
    }
    if settings.num_replicas is not None:
        options["num_replicas"] = settings.num_replicas
    else:
        autoscaling: dict[str, Any] = {
            "min_replicas": settings.min_replicas,
            "initial_replicas": max(1, settings.min_replicas),
            "max_replicas": settings.max_replicas,
            "look_back_period_s": settings.look_back_period_s,
            "upscale_delay_s": settings.upscale_delay_s,
            "downscale_delay_s": settings.downscale_delay_s,
        }
        push_interval = settings.look_back_period_s / 2
        if push_interval < DEFAULT_METRICS_INTERVAL_S:
            # Serve pushes each replica's metric to its controller every `metrics_interval_s` (10 s by default) and
            # wants the look-back window longer than that; a shorter window gets pushes twice within it (the field
            # is deprecated for environment variables that Ray 2.60 does not read yet: docs/ray.md, Autoscaling)
            autoscaling["metrics_interval_s"] = push_interval
        if settings.autoscale_on == "engine-load":
            # Serve applies the delays and min/max to what the policy returns (autoscaling.py's docstring)
            autoscaling["policy"] = {"policy_function": POLICY,
                                     "policy_kwargs": {"target_engine_load": settings.target_engine_load}}
        else:
            autoscaling["target_ongoing_requests"] = settings.target_ongoing_requests
        options["autoscaling_config"] = autoscaling
    return options


def build_app(settings: RayServeSettings) -> Application:
    """The application: `EngineReplica` as the ingress, `MetricsHub` (one replica, no resources) bound to it."""
    settings.validate()
    hub = serve.deployment(name=METRICS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0})(MetricsHub)
    engines = serve.deployment(**deployment_options(settings))(serve.ingress()(EngineReplica))
    return engines.bind(settings, hub.bind())


def config_settings(args: dict[str, Any]) -> RayServeSettings:
    """The settings of a Serve config file's `args` (RayServeSettings' fields). The server's `api_key`,
    when the config does not set it, is $QWEN3TTS_API_KEY of the deploying shell."""
    server = dict(args.get("server") or {})
    if not server.get("api_key") and os.environ.get(API_KEY_ENV):
        server["api_key"] = os.environ[API_KEY_ENV]
    return RayServeSettings.from_dict({**args, "server": server})


def app_builder(args: dict[str, Any]) -> Application:
    """For `serve run` / `serve deploy` with a config file (`import_path: qwen3tts_agent.ray.app:app_builder`)."""
    return build_app(config_settings(args))
