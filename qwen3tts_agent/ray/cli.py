"""`qwen3tts-agent serve-ray`: the server's endpoint in front of many engine replicas on a Ray cluster."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from typing import Any

import ray  # imported here so a missing [ray] extra shows when the CLI registers `serve-ray`
from ray import serve

from ..server.cli import add_server_arguments, server_config_from_args
from ..server.config import ServerConfig
from .direct import (
    DIRECT_INGRESS_ENV,
    DRAINING_PERIOD_ENV,
    LOCAL_DRAINING_PERIOD_S,
    DirectIngress,
    direct_ingress,
    enabled_in_environment,
)
from .settings import AUTOSCALE_SIGNALS, ENGINE_CORES, RayServeSettings

logger = logging.getLogger(__name__)


def add_serve_ray_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve-ray` on the main CLI's sub-parsers."""
    p = subparsers.add_parser(
        "serve-ray", help="run the server's endpoint over engine replicas on a Ray cluster (one per GPU)"
    )
    add_server_arguments(p)
    d = RayServeSettings(model="")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas (fixed; see --max-replicas to autoscale)")
    p.add_argument("--min-replicas", type=int, default=d.min_replicas, help="autoscaling: fewest replicas")
    p.add_argument("--max-replicas", type=int,
                   help="autoscale between --min-replicas and this, on --autoscale-on")
    p.add_argument("--autoscale-on", choices=AUTOSCALE_SIGNALS,
                   help="autoscaling: what to scale on: each replica's engine load (utterances per synthesis slot, "
                   "sessions per --max-sessions, 1 when the engine refuses for running behind) or Serve's ongoing "
                   "requests (default: engine-load, or ongoing-requests where --target-ongoing-requests is given)")
    p.add_argument("--target-engine-load", type=float,
                   help=f"autoscaling on engine-load: the replicas' mean load to keep (0 to 1; default "
                   f"{d.target_engine_load})")
    p.add_argument("--target-ongoing-requests", type=float,
                   help=f"autoscaling on ongoing-requests: ongoing requests per replica the autoscaler aims at "
                   f"(default {d.target_ongoing_requests:g}; a WebSocket session counts while it is open, a fraction "
                   "of its audio's playing time: docs/ray.md)")
    p.add_argument("--upscale-delay", type=float, default=d.upscale_delay_s,
                   help="autoscaling: seconds the wish for more replicas must hold before one is added")
    p.add_argument("--downscale-delay", type=float, default=d.downscale_delay_s,
                   help="autoscaling: seconds the wish for fewer replicas must hold before one is removed")
    p.add_argument("--look-back-period", type=float, default=d.look_back_period_s,
                   help="autoscaling: seconds over which each replica's engine load (or the ongoing requests) "
                   "is averaged")
    p.add_argument("--engine-core", choices=ENGINE_CORES, default=d.engine_core,
                   help="the engine's step loop on a thread of each replica, or in a child process of it")
    p.add_argument("--num-gpus", type=float, help="GPUs per replica (default: 1 where this machine has CUDA, else 0)")
    p.add_argument("--num-cpus", type=float, default=d.num_cpus, help="CPUs each replica reserves in Ray")
    p.add_argument("--torch-threads", type=int, help="torch threads per replica (default: torch's own)")
    p.add_argument("--max-ongoing-requests", type=int,
                   help="Serve's cap per replica (default: --max-sessions + --max-queued + 64)")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests a proxy holds while every replica is at its cap; beyond: 503 busy")
    p.add_argument("--health-check-period", type=float, default=d.health_check_period_s, help="seconds between health checks")
    p.add_argument("--routing-stats-period", type=float, default=d.routing_stats_period_s,
                   help="seconds between the replicas' load reports to the routers")
    p.add_argument("--address", help="Ray cluster to join ('auto': the one `ray start` runs on this node); "
                   "default: start a Ray instance here")
    p.add_argument("--ray-num-cpus", type=int, help="CPUs of the Ray instance started here (default: all)")
    p.add_argument("--direct-ingress", action="store_true",
                   help="Serve's direct ingress (experimental in Ray): each replica also serves a port of its own "
                   "(30000 up), without the proxy's hop; spread clients over them (GET /v1/replicas lists them). "
                   f"A property of the Ray cluster: set for the instance started here; with --address, the cluster "
                   f"must run with {DIRECT_INGRESS_ENV}=1 (docs/ray.md)")
    p.add_argument("--app-name", default=d.app_name, help="the Serve application's name")
    p.add_argument("--print-config", action="store_true",
                   help="print the equivalent Serve config file (for `serve run` / `serve deploy`) and exit")
    p.set_defaults(func=run_serve_ray)
    return p


def settings_from_args(args: argparse.Namespace) -> RayServeSettings:
    num_gpus = args.num_gpus
    if num_gpus is None:
        import torch

        num_gpus = 1.0 if args.device != "cpu" and torch.cuda.is_available() else 0.0
    autoscale = args.max_replicas is not None
    d = RayServeSettings(model="")
    autoscale_on = autoscale_signal(args)
    return RayServeSettings(
        model=args.model,
        server=server_config_from_args(args),
        device=args.device,
        dtype=args.dtype,
        max_streams="auto" if args.max_streams == "auto" else int(args.max_streams),
        backend=args.backend,
        codec_hold_ms=args.codec_hold_ms,
        step_period_ms=args.step_period_ms,
        first_frame_step_load=args.first_frame_step_load,
        clock_first_frame_load=args.clock_first_frame_load,
        shed_lateness_ms=args.shed_lateness_ms,
        max_seq_len=args.max_seq_len,
        chunk_schedule=args.chunk_schedule,
        engine_core=args.engine_core,
        torch_threads=args.torch_threads,
        num_replicas=None if autoscale else args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas if autoscale else args.replicas,
        autoscale_on=autoscale_on,
        target_engine_load=d.target_engine_load if args.target_engine_load is None else args.target_engine_load,
        target_ongoing_requests=(
            d.target_ongoing_requests if args.target_ongoing_requests is None else args.target_ongoing_requests
        ),
        upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay,
        look_back_period_s=args.look_back_period,
        num_gpus=num_gpus,
        num_cpus=args.num_cpus,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        health_check_period_s=args.health_check_period,
        routing_stats_period_s=args.routing_stats_period,
        app_name=args.app_name,
    )


def autoscale_signal(args: argparse.Namespace) -> str:
    """`--autoscale-on`, or what the targets given imply: ongoing-requests where only --target-ongoing-requests
    is given (command lines from before --autoscale-on), else engine-load. A target of the signal not chosen is
    ignored, with a note (so a script's target stays valid when --autoscale-on is added to it)."""
    engine_target = args.target_engine_load is not None
    ongoing_target = args.target_ongoing_requests is not None
    if args.autoscale_on is None:
        if engine_target and ongoing_target:
            raise ValueError("--target-engine-load and --target-ongoing-requests are targets of two signals: "
                             "choose one with --autoscale-on")
        return "ongoing-requests" if ongoing_target else "engine-load"
    ignored = (
        "--target-ongoing-requests" if args.autoscale_on == "engine-load" and ongoing_target
        else "--target-engine-load" if args.autoscale_on == "ongoing-requests" and engine_target
        else None
    )
    if ignored is not None:
        print(f"note: {ignored} is ignored with --autoscale-on {args.autoscale_on}", file=sys.stderr)
    return str(args.autoscale_on)


def engine_load_caveat(settings: RayServeSettings) -> str | None:
    """What to tell someone who autoscales GPU replicas on the engines' load with slots that fit memory: the load
    is utterances over slots, and `--max-streams auto` fits the device's memory (or a replica's share of it),
    which may exceed what the device computes in real time, so the load reaches the target only as the replica
    falls behind (measured on an H100: docs/ray.md, Autoscaling). None where none of that holds."""
    autoscaling = settings.num_replicas is None and settings.max_replicas > settings.min_replicas
    if not (autoscaling and settings.autoscale_on == "engine-load" and settings.num_gpus > 0):
        return None
    if settings.max_streams != "auto" or settings.server.max_active_streams is not None:
        return None
    return ("engine-load autoscaling measures each replica's synthesis slots in use, and --max-streams auto fits "
            "memory rather than what a replica computes in real time, so a replica may fall behind before its "
            "load reaches --target-engine-load: set --max-active-streams to the streams one replica carries in "
            "real time (docs/ray.md, Autoscaling)")


def serve_config(settings: RayServeSettings) -> dict[str, Any]:
    """The Serve config file equivalent to these settings. The API key stays out: `app_builder` reads it
    from $QWEN3TTS_API_KEY where the config is deployed. The server's host and port stay in (the replicas
    refuse a non-loopback host without a key) and are the proxies' too."""
    args = settings.to_dict()
    args["server"].pop("api_key", None)
    server = settings.server
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": server.host, "port": server.port, "keep_alive_timeout_s": math.ceil(server.keep_alive_timeout_s)},
        "applications": [{
            "name": settings.app_name,
            "route_prefix": settings.route_prefix,
            "import_path": "qwen3tts_agent.ray.app:app_builder",
            "args": args,
        }],
    }


def direct_ingress_problem(asked: bool, local: bool, enabled: bool | None) -> tuple[str | None, str | None]:
    """(error, warning) for --direct-ingress once the Serve controller has said whether it runs direct ingress
    (`enabled`; None: it could not be asked). Joining a cluster without it is refused: the replicas read the
    variable when their processes start, so only a cluster started with it can have it."""
    if not asked or enabled:
        return None, None
    if enabled is None:
        return None, ("could not confirm that this Ray cluster runs Serve's direct ingress (asking its controller "
                      "failed); the replicas' own ports may not exist")
    if local:
        return (f"Serve's controller started without direct ingress although {DIRECT_INGRESS_ENV}=1 was set for it "
                "(a Serve instance that already ran in this Ray instance?)"), None
    return (f"this Ray cluster does not run Serve's direct ingress: start every node with "
            f"`{DIRECT_INGRESS_ENV}=1 ray start ...` (and no Serve instance running yet), or leave out "
            f"--direct-ingress"), None


def report_direct_endpoints(found: DirectIngress, app_name: str, replicas: int | None) -> None:
    """Print (and log) each replica's own endpoint once the replicas run under direct ingress; warn where fewer
    than the `replicas` deployed (a fixed count) have one."""
    if found.enabled is None:
        print(f"warning: could not list the replicas' direct endpoints: {found.error}", file=sys.stderr, flush=True)
        return
    if not found.endpoints:
        print("warning: direct ingress is on but Serve lists no replica endpoint yet; GET /v1/replicas lists "
              "them once it does", file=sys.stderr, flush=True)
        return
    for endpoint in found.endpoints:
        line = f"replica {endpoint.replica} of {app_name}: direct endpoint {endpoint.ws} (WebSocket: /v1/stream)"
        print(line, flush=True)
        logger.info(line)
    if replicas is not None and len(found.endpoints) < replicas:
        print(f"warning: {len(found.endpoints)} of the {replicas} replicas have a direct endpoint (nodes started "
              f"without {DIRECT_INGRESS_ENV}=1?)", file=sys.stderr, flush=True)
    print("direct ingress: clients or a load balancer spread sessions over these ports (the proxy's router does "
          "not); GET /v1/replicas lists them as replicas come and go", flush=True)


def run_serve_ray(args: argparse.Namespace) -> int:
    """Deploy and serve until interrupted; 2 for bad settings, 1 if the replicas failed to start."""
    from .app import ENGINE_DEPLOYMENT, build_app
    from .proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV
    from .transport import proxy_limits_environment

    try:
        if args.max_streams != "auto" and not args.max_streams.isdigit():
            raise ValueError(f"--max-streams must be a number or 'auto', got {args.max_streams!r}")
        settings = settings_from_args(args)
        settings.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if (caveat := engine_load_caveat(settings)) is not None:
        print(f"note: {caveat}", file=sys.stderr)
    if args.print_config:
        import yaml  # Ray's own dependency

        if args.direct_ingress:
            print(f"note: direct ingress is not in a Serve config: export {DIRECT_INGRESS_ENV}=1 before `serve run` "
                  "(it starts the Ray instance) or before `ray start` on every node (docs/ray.md)", file=sys.stderr)
        proxy_limits = proxy_limits_environment(settings.server)
        if proxy_limits != proxy_limits_environment(ServerConfig()):
            (name, value), = proxy_limits.items()
            print(f"note: the proxies' connection limits are not in a Serve config: export {name}='{value}' before "
                  "`serve run` or before `ray start` on every node (docs/ray.md)", file=sys.stderr)
        print(yaml.safe_dump(serve_config(settings), sort_keys=False), end="")
        return 0
    local = args.address is None
    if local:  # Serve's processes of a Ray instance started here read these when they start
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
        os.environ.update(proxy_limits_environment(settings.server))  # the proxies' connection bounds
        if args.direct_ingress:
            os.environ[DIRECT_INGRESS_ENV] = "1"
        if enabled_in_environment():  # a stopping replica's port stays open this long (Ray's default: 30 s)
            os.environ.setdefault(DRAINING_PERIOD_ENV, f"{LOCAL_DRAINING_PERIOD_S:g}")
    ray.init(address=args.address, num_cpus=args.ray_num_cpus if local else None, include_dashboard=False)
    config = settings.server
    deployed = False
    try:
        serve.start(
            proxy_location="EveryNode",
            http_options={"host": config.host, "port": config.port,
                          "keep_alive_timeout_s": math.ceil(config.keep_alive_timeout_s)},
        )
        enabled = direct_ingress(settings.app_name, ENGINE_DEPLOYMENT).enabled if args.direct_ingress else None
        error, warning = direct_ingress_problem(args.direct_ingress, local, enabled)
        if error is not None:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if warning is not None:
            print(f"warning: {warning}", file=sys.stderr)
        try:
            deployed = True
            serve.run(build_app(settings), name=settings.app_name, route_prefix=settings.route_prefix,
                      logging_config={"log_level": args.log_level.upper()})
        except RuntimeError as exc:
            print(f"error: the replicas failed to start: {exc}", file=sys.stderr)
            return 1
        print(f"serving {args.model} at http://{config.host}:{config.port} (WebSocket: /v1/stream); Ctrl-C stops",
              flush=True)
        found = direct_ingress(settings.app_name, ENGINE_DEPLOYMENT)
        if args.direct_ingress or found.enabled:
            report_direct_endpoints(found, settings.app_name, settings.num_replicas)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        # a second Ctrl-C stops at once, without waiting for the sessions (a Ray instance started here still stops)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return 0
    finally:
        try:
            if local:
                serve.shutdown()  # waits for the replicas' sessions up to their graceful shutdown timeout (<= 30 s)
            elif deployed:
                serve.delete(settings.app_name)
        except KeyboardInterrupt:
            print("stopping at once", file=sys.stderr)
        finally:
            ray.shutdown()
