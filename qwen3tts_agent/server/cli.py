"""`qwen3tts-agent serve`: one engine, many clients, over WebSocket and HTTP."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from .config import ServerConfig, check_chunk_schedule, default_voices_dir, engine_tuning

MAX_AUTO_WORKERS = 4
# The [server] extra's packages, looked up (not imported) when the CLI registers `serve`, so a missing extra
# shows there; they are imported once the engine core has been started (`launcher.serve`).
SERVER_PACKAGES = ("uvicorn", "fastapi", "websockets")


def _require_installed(packages: tuple[str, ...]) -> None:
    missing = next((p for p in packages if importlib.util.find_spec(p) is None), None)
    if missing is not None:
        raise ImportError(f"No module named {missing!r}", name=missing)


_require_installed(SERVER_PACKAGES)


def chunk_schedule(text: str) -> tuple[int, ...]:
    """`--chunk-schedule`: comma-separated frames per chunk ("1,2,4,8"; the last repeats)."""
    try:
        schedule = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"frames per chunk, comma-separated (e.g. 1,2,4,8), not {text!r}") from None
    try:
        return check_chunk_schedule(schedule)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` on the main CLI's sub-parsers."""
    p = subparsers.add_parser("serve", help="run the streaming TTS server (WebSocket + OpenAI-compatible HTTP)")
    add_server_arguments(p)
    p.add_argument("--engine-core", choices=["process", "thread"], default="process",
                   help="run the engine's step loop in a process of its own (default; restarted if it dies) "
                   "or on a thread of the server's process")
    p.add_argument("--workers", default="auto",
                   help="API worker processes sharing the port (with --engine-core process); 'auto': one per 4 CPU "
                   "cores, up to 4 (one with --device cpu, whose engine serves few streams)")
    p.set_defaults(func=run_serve)
    return p


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The model, engine and server options `serve` shares with `serve-ray` (qwen3tts_agent.ray)."""
    d = ServerConfig()
    p.add_argument("--model", required=True, help="hub id, local checkpoint folder, or synthetic:<size>[-<type>]")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="float32 or bfloat16 (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--host", default=d.host, help="bind address (anything but loopback requires --api-key)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--api-key", default=os.environ.get("QWEN3TTS_API_KEY"),
                   help="bearer token clients must send (default: $QWEN3TTS_API_KEY)")
    p.add_argument("--voices-dir", type=Path, default=default_voices_dir(), help="where registered voices persist")
    p.add_argument("--default-voice", help="voice for OpenAI voice names and sessions naming none: "
                   "a registered voice id/name or a CustomVoice speaker")
    p.add_argument("--default-voice-audio", type=Path, help="reference recording registered as the default voice")
    p.add_argument("--default-voice-text", help="transcript of --default-voice-audio (omit: x-vector-only cloning)")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions,
                   help="concurrent WebSocket sessions: one figure for all of serve's API workers (per replica "
                   "with serve-ray)")
    p.add_argument("--max-active-streams", type=int,
                   help="utterances synthesized at once, per API worker (default: engine slots); docs/server.md")
    p.add_argument("--max-queued", type=int, default=d.max_queued,
                   help="utterances waiting for a slot before 'busy': one figure for all of serve's API workers "
                   "(per replica with serve-ray)")
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s, help="seconds to wait for a slot")
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars, help="characters per utterance")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="largest WebSocket message / JSON body")
    p.add_argument("--max-frames", type=int, default=d.max_frames, help="cap on utterance length, 80 ms frames")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s, help="seconds before an idle session closes")
    p.add_argument("--send-timeout", type=float, default=d.send_timeout_s,
                   help="seconds a client may leave audio unread before its utterances are cancelled and it is closed")
    p.add_argument("--send-buffer", type=int, default=d.send_buffer_bytes,
                   help="bytes queued per connection before sends wait for the client")
    p.add_argument("--http-read-timeout", type=float, default=d.http_read_timeout_s,
                   help="seconds for an HTTP request's head, and then its body, to arrive")
    p.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout_s,
                   help="seconds an idle keep-alive HTTP connection stays open")
    p.add_argument("--max-streams", default="auto",
                   help="engine stream slots (rows of the batched step); 'auto': what the device holds "
                   "(up to 256 on a GPU, by free memory; 16 on the CPU)")
    p.add_argument("--max-seq-len", type=int,
                   help="positions a stream slot holds: its prompt and its audio frames (default 2048); each slot's "
                   "KV cache is sized by it, so fewer positions fit more slots in the device's memory (an utterance "
                   "ends where its slot's positions run out); docs/server.md")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "int8", "int4", "fp32"),
                   help="model maths: auto (int8 ONNX Runtime graphs on a CPU, PyTorch + Triton on a GPU), torch, "
                   "int8, int4 (4-bit weights: faster, coarser), fp32; see docs/cpu-backend.md")
    p.add_argument("--codec-hold-ms", type=float,
                   help="how long a stream's later audio chunk may wait to be decoded in one codec call with other "
                   "streams' chunks while its listener has audio to spare (default 0: decode each as soon as the "
                   "codec has room); docs/server.md")
    p.add_argument("--step-period-ms", type=float,
                   help="under load, start a batched frame step at most this often, so the device keeps room for "
                   "new streams (each stream then runs at about 80 / this times real time; default: 20 on a GPU, "
                   "0 on the CPU; 0: steps back to back); docs/server.md")
    p.add_argument("--first-frame-step-load", type=int,
                   help="from this many streams stepping at once, a new stream's first frames run in small steps "
                   "of their own instead of waiting for the batched step (default: 8 on a GPU, never on the CPU; "
                   "0: never, new streams join the batched steps: fewer, fuller steps under heavy load); "
                   "docs/server.md")
    p.add_argument("--chunk-schedule", type=chunk_schedule,
                   help="frames per audio chunk for sessions that name none, comma-separated, the last repeating "
                   "(default: 1,2,4,8); a session's `start` may still set its own; docs/server.md")
    p.add_argument("--clock-first-frame-load", type=int,
                   help="from this many streams stepping at once, a new stream's first frame also waits for the step "
                   "clock's tick (fuller steps on a full device, a few ms more to first audio; default: 96; 0: never); "
                   "docs/server.md")
    p.add_argument("--shed-lateness-ms", type=float,
                   help="how late a chunk must leave the engine to count towards refusing new streams as `busy` "
                   "(default 0: any lateness; late chunks are counted in /metrics either way); docs/server.md")
    p.add_argument("--no-warmup", action="store_true", help="report ready without a warm-up utterance")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the options of `add_server_arguments` describe (not validated yet)."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        model_name=args.model,
        voices_dir=args.voices_dir,
        default_voice=args.default_voice,
        default_voice_audio=args.default_voice_audio,
        default_voice_text=args.default_voice_text,
        max_sessions=args.max_sessions,
        max_active_streams=args.max_active_streams,
        max_queued=args.max_queued,
        queue_timeout_s=args.queue_timeout,
        max_text_chars=args.max_text_chars,
        max_message_bytes=args.max_message_bytes,
        max_frames=args.max_frames,
        idle_timeout_s=args.idle_timeout,
        send_timeout_s=args.send_timeout,
        send_buffer_bytes=args.send_buffer,
        http_read_timeout_s=args.http_read_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        warmup=not args.no_warmup,
    )


def engine_options(args: argparse.Namespace, max_streams: int | str) -> dict[str, Any]:
    """The `Engine` keyword arguments the options of `add_server_arguments` set (others keep their defaults)."""
    return {"max_streams": max_streams, "backend": args.backend, **engine_tuning(vars(args))}


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; 2 for bad settings, 1 if the model failed to load."""
    config = server_config_from_args(args)
    try:
        config.validate()
        max_streams: int | str = "auto" if args.max_streams == "auto" else int(args.max_streams)
        workers = api_workers(args.workers, engine_core=args.engine_core, device=args.device)
        engine_kwargs = engine_options(args, max_streams)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.engine_core == "process":
        from ..engine.process import CoreLaunch
        from .launcher import default_core_address, serve

        launch = CoreLaunch(
            args.model, default_core_address(), device=args.device, dtype=args.dtype,
            engine_kwargs=engine_kwargs, warmup=config.warmup,
            log_level=args.log_level,
        )
        return serve(config, launch, workers=workers, log_level=args.log_level)
    import uvicorn

    from ..engine.frontend import Engine  # the engine core on a thread of this process
    from .app import create_app
    from .connections import uvicorn_config
    from .launcher import show_server_logs

    show_server_logs(args.log_level)
    app = create_app(config, engine_factory=lambda: Engine.load(
        args.model, device=args.device, dtype=args.dtype, **engine_kwargs
    ))
    server = uvicorn.Server(uvicorn_config(app, config, log_level=args.log_level))
    state = app.state.server
    state.on_failure = lambda _exc: setattr(server, "should_exit", True)
    server.run()
    return 1 if state.failure else 0


def api_workers(option: str, *, engine_core: str, device: str) -> int:
    """`--workers`: a number, or "auto". One API worker's event loop (JSON, PCM, WebSocket frames for every
    session it holds) falls behind a GPU engine at about 20 new utterances a second, so "auto" gives one per
    4 cores, up to 4; one where they cannot help (an engine core on a thread of the server, or the CPU)."""
    if option == "auto":
        if engine_core == "thread" or device == "cpu":
            return 1
        return max(1, min(MAX_AUTO_WORKERS, (os.cpu_count() or 1) // 4))
    workers = int(option)
    if workers < 1 or (workers > 1 and engine_core == "thread"):
        raise ValueError("--workers must be at least 1, and above 1 only with --engine-core process")
    return workers
