"""Turn latency: from an LLM's FIRST text token to the first audio, with the reply's text paced like an LLM's.

What a voice-agent caller feels is not "whole text in -> first audio" but "the LLM starts answering -> speech
starts". Here the reply (`REPLY`) is cut into the Qwen tokenizer's tokens, each decoded to its text piece,
and the pieces arrive like an LLM's stream: the first at t = 0, then one every 1/rate seconds (30, 60 and
100 tokens/s). First audio is timed from the first piece to the first PCM at the consumer, through:

- `engine`: the engine API in this process (`open_stream` on the first piece, `push_text` for each);
- `pipecat-token`, `pipecat-sentence`: `Qwen3TTSService` in a real Pipecat pipeline, the pieces as
  `LLMTextFrame`s, TOKEN and SENTENCE aggregation (the timer stops at the first `TTSAudioRawFrame` out);
- `ws`: the server's WebSocket, app and engine in this process (`create_app` on uvicorn, loopback), one
  session per voice (opened before the turn, as pooled clients do), each piece a `text` message.

Voices: a CustomVoice speaker (CustomVoice models), an x-vector clone and in-context (ICL) clones with 2 s, 4 s
and 8 s references (Base models; `demo_reference` cut or looped, transcripts of matching length), and the
two ways to shorten an ICL clone's wait for text: the 8 s reference trimmed (`create_voice(max_ref_seconds=)`)
and the opt-in early start (`Voice.icl_early_start`, not the official prompt; not offered by the server).
Each voice speaks one turn first, unmeasured (a voice's first turn prefills its prompt head; later turns
copy it from the prefix store). Utterances are fixed-length (`ignore_eos`, `--frames`); a turn is cancelled
once its first audio is in (engine, ws) or ends with its text (Pipecat). The report gives, per cell, first
audio p50/p95 and, where the engine's result is at hand (engine, Pipecat), `text_wait` (how long the first
frame waited for text) and first audio less that wait (what the engine adds once the text is there).
The engine runs a streamed text's first frame on its second token before that token is final and holds the
audio until it is (`Engine(speculative_first_frame=True)`, the default); `--no-speculation` measures the
engine that waits for the token first.

    python -m benchmarks.serving.turn_latency --models synthetic:0.6b,synthetic:0.6b-customvoice --out turn.json
    python -m benchmarks.serving.turn_latency --models synthetic:tiny,synthetic:tiny-customvoice --device cpu --quick
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import platform
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qwen3tts_agent import Engine, SamplingParams, Voice, VoicePrompt
from qwen3tts_agent.engine.frontend import trim_reference
from qwen3tts_agent.reference import demo_reference

# An agent's reply: a short first sentence, then numbers, names and clauses; long enough (101 tokens) to
# cover the text an 8 s reference's span needs.
REPLY = (
    "Sure, I can help you with that. Your booking reference is QX7-4821, and the flight leaves Lisbon at 9:45 "
    "tomorrow morning from terminal two. I have also added the extra bag you asked about, so the total now "
    "comes to 212 euros, taxes included. Would you like me to send the confirmation to the email address we "
    "have on file, or shall I read the details out again, slowly, so that you can write them down?"
)
# Reference transcripts about as long as the reference audio (~3 words a second)
REFERENCE_TEXTS = {
    2.0: "Hello, this is my voice.",
    4.0: "Hello, this is my voice. I am reading a short line for you.",
    8.0: "Hello, this is my voice. I am reading a short line for you. It goes on for a few more words, slowly "
    "and clearly, until the end.",
}
TRIM_TO_S = 2.5  # the trimmed row: the 8 s reference cut to whole sentences within this
MARGIN_TOKENS = 8  # text beyond what the first frame needs (Pipecat turns run to their text's end)
MIN_TOKENS = 16  # at least this much text per turn: SENTENCE mode needs the first sentence and the next token
PATHS = ("engine", "pipecat-token", "pipecat-sentence", "ws")


@dataclass(frozen=True)
class VoiceCase:
    """A row's voice: `kind` customvoice, xvector or icl; an ICL reference's seconds, trim and early start."""

    kind: str
    ref_seconds: float = 0.0
    trim_to: float | None = None
    early_start: bool = False


VOICES = {
    "customvoice": VoiceCase("customvoice"),
    "xvector": VoiceCase("xvector", 4.0),
    "icl-2s": VoiceCase("icl", 2.0),
    "icl-4s": VoiceCase("icl", 4.0),
    "icl-8s": VoiceCase("icl", 8.0),
    "icl-8s-trimmed": VoiceCase("icl", 8.0, trim_to=TRIM_TO_S),
    "icl-8s-early-start": VoiceCase("icl", 8.0, early_start=True),
}


@dataclass
class PreparedVoice:
    name: str
    case: VoiceCase
    voice: Voice
    needed_tokens: int  # target-text tokens the first frame needs (`PromptShape.first_frame_ready`)
    reference: tuple[np.ndarray, int] | None = None  # what the server registers (after any trim)
    ref_text: str | None = None
    ref_seconds: float = 0.0  # the reference the voice was made of (after any trim)


@dataclass
class Trial:
    first_audio_s: float
    text_wait_s: float | None = None


@dataclass
class Cell:
    model: str
    voice: str
    path: str
    rate: float
    trials: list[Trial] = field(default_factory=list)
    error: str | None = None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if len(values) else None


def text_pieces(engine: Engine, text: str) -> list[str]:
    """`text` as an LLM streams it: one piece per Qwen token, each the text its token adds (a token that ends
    inside a multi-byte character adds nothing until the token that completes it)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(engine.tokenizer.to_json())
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    pieces, done = [], ""
    for i in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:i])
        if decoded.endswith("\ufffd"):
            pieces.append("")
            continue
        pieces.append(decoded[len(done) :])
        done = decoded
    if "".join(pieces) != text:
        raise ValueError("the tokens do not decode back to the reply")
    return pieces


def reference_audio(seconds: float) -> tuple[np.ndarray, int]:
    wav, sr = demo_reference()
    return np.resize(wav, int(seconds * sr)), sr


def prepare_voice(engine: Engine, name: str, case: VoiceCase) -> PreparedVoice:
    if case.kind == "customvoice":
        return PreparedVoice(name, case, Voice(speaker=engine.speakers[0]), needed_tokens=2)
    wav, sr = reference_audio(case.ref_seconds)
    if case.kind == "xvector":
        prompt = engine.create_voice((wav, sr), None, x_vector_only=True)
        return PreparedVoice(name, case, Voice(prompt=prompt), 2, (wav, sr), None, case.ref_seconds)
    text = REFERENCE_TEXTS[case.ref_seconds]
    if case.trim_to is not None:
        wav, text = trim_reference(wav, sr, text, case.trim_to)
    prompt = engine.create_voice((wav, sr), text)
    needed = icl_needed_tokens(engine, prompt)
    voice = Voice(prompt=prompt, icl_early_start=case.early_start)
    return PreparedVoice(name, case, voice, 1 if case.early_start else needed, (wav, sr), text, len(wav) / sr)


def icl_needed_tokens(engine: Engine, prompt: VoicePrompt) -> int:
    """Target tokens an in-context clone's first frame needs: codec_bos + the reference's frames, less the
    reference transcript's tokens, plus the token the first frame's talker step reads."""
    assert prompt.ref_codes is not None and prompt.ref_text is not None
    return max(0, 1 + int(prompt.ref_codes.shape[0]) + 1 - len(engine.tokenizer.ref_ids(prompt.ref_text)))


async def paced(pieces: Sequence[str], rate: float, t0: float, send: Callable[[str], Awaitable[None] | None]) -> None:
    """Send pieces[1:] at t0 + i / rate (pieces[0] went at t0)."""
    for i, piece in enumerate(pieces[1:], start=1):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if piece:
            result = send(piece)
            if result is not None:
                await result


# ----------------------------------------------------------------------------- the engine API
async def engine_trial(engine: Engine, voice: PreparedVoice, pieces: list[str], rate: float, sampling: SamplingParams) -> Trial:
    t0 = time.perf_counter()
    stream = engine.open_stream(voice=voice.voice, language="english", sampling=sampling)
    stream.push_text(pieces[0])

    async def feed() -> None:
        await paced(pieces, rate, t0, stream.push_text)
        stream.close_input()

    feeder = asyncio.create_task(feed())
    first = None
    async for _ in stream:
        first = time.perf_counter()
        break
    feeder.cancel()
    await asyncio.gather(feeder, return_exceptions=True)
    await stream.acancel()
    if first is None:
        raise RuntimeError(f"no audio (finish reason {stream.result.finish_reason})")
    return Trial(first - t0, stream.result.text_wait)


# ----------------------------------------------------------------------------- Pipecat
async def pipecat_trial(
    engine: Engine, voice: PreparedVoice, pieces: list[str], rate: float, sampling: SamplingParams, mode: str
) -> Trial:
    from pipecat.frames.frames import (
        EndFrame,
        Frame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        TTSAudioRawFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.tts_service import TextAggregationMode
    from pipecat.workers.runner import WorkerRunner

    from qwen3tts_agent.pipecat import Qwen3TTSService, UtteranceReport

    class FirstAudio(FrameProcessor):
        """Stamps the first audio frame that leaves the TTS service."""

        def __init__(self) -> None:
            super().__init__()
            self.at: float | None = None

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame) and self.at is None:
                self.at = time.perf_counter()
            await self.push_frame(frame, direction)

    prompt = voice.voice.prompt
    settings = Qwen3TTSService.Settings(
        voice="v" if prompt is not None else None, speaker=voice.voice.speaker, sampling=sampling,
        language="english", icl_early_start=voice.voice.icl_early_start,
    )
    tts = Qwen3TTSService(
        engine=engine, voices={"v": prompt} if prompt is not None else None, settings=settings,
        text_aggregation_mode=TextAggregationMode.TOKEN if mode == "pipecat-token" else TextAggregationMode.SENTENCE,
    )
    reports: list[UtteranceReport] = []

    @tts.event_handler("on_utterance_finished")
    async def on_utterance_finished(_service: Qwen3TTSService, report: UtteranceReport) -> None:
        reports.append(report)

    probe = FirstAudio()
    worker = PipelineWorker(Pipeline([tts, probe]), cancel_on_idle_timeout=False, params=PipelineParams())
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(_worker: PipelineWorker, _frame: Frame) -> None:
        started.set()

    t0 = 0.0

    async def drive() -> None:
        nonlocal t0
        await asyncio.wait_for(started.wait(), 10)
        t0 = time.perf_counter()
        await worker.queue_frame(LLMFullResponseStartFrame())
        await worker.queue_frame(LLMTextFrame(pieces[0]))
        await paced(pieces, rate, t0, lambda piece: worker.queue_frame(LLMTextFrame(piece)))
        await worker.queue_frame(LLMFullResponseEndFrame())
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    if probe.at is None:
        raise RuntimeError("no audio frame left the TTS service")
    text_wait = reports[0].result.text_wait if reports else None
    return Trial(probe.at - t0, text_wait)


# ----------------------------------------------------------------------------- the server's WebSocket
class InProcessServer:
    """The server app around this process's engine, on uvicorn in a thread, on a loopback port."""

    def __init__(self, engine: Engine, model: str) -> None:
        import uvicorn

        from qwen3tts_agent.server import ServerConfig, create_app
        from qwen3tts_agent.server.connections import uvicorn_config

        self._voices_dir = tempfile.TemporaryDirectory(prefix="turn-latency-voices-")
        config = ServerConfig(model_name=model, voices_dir=Path(self._voices_dir.name), warmup=False, max_frames=2047)
        app = create_app(config, engine=engine)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn_config(app, config, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)

    def register(self, name: str, voice: PreparedVoice) -> str:
        """The voice's name for `start`: a registered clone (POST /v1/voices), or the CustomVoice speaker."""
        import httpx
        import soundfile as sf

        if voice.reference is None:
            assert voice.voice.speaker is not None
            return voice.voice.speaker
        buffer = io.BytesIO()
        sf.write(buffer, voice.reference[0], voice.reference[1], format="WAV", subtype="FLOAT")
        body = {"audio": base64.b64encode(buffer.getvalue()).decode(), "name": name,
                "ref_text": voice.ref_text, "x_vector_only": voice.case.kind == "xvector"}
        response = httpx.post(f"http://127.0.0.1:{self.port}/v1/voices", json=body, timeout=120)
        if response.status_code not in (200, 201):
            raise RuntimeError(f"registering {name}: {response.status_code} {response.text}")
        return name

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._voices_dir.cleanup()


class WsSession:
    """One WebSocket session with a voice, reused for every turn of a cell."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    @classmethod
    async def open(cls, port: int, voice_name: str, frames: int) -> WsSession:
        from websockets.asyncio.client import connect

        ws = await connect(f"ws://127.0.0.1:{port}/v1/stream", max_size=None, proxy=None)
        start = {"type": "start", "voice": voice_name, "language": "english",
                 "sampling": {"max_frames": frames, "ignore_eos": True}}
        await ws.send(json.dumps(start))
        ready = json.loads(await ws.recv())
        if ready.get("type") != "ready":
            raise RuntimeError(f"start refused: {ready}")
        return cls(ws)

    async def trial(self, pieces: list[str], rate: float) -> Trial:
        ws = self.ws
        t0 = time.perf_counter()
        await ws.send(json.dumps({"type": "text", "text": pieces[0]}))

        async def feed() -> None:
            await paced(pieces, rate, t0, lambda piece: ws.send(json.dumps({"type": "text", "text": piece})))
            await ws.send(json.dumps({"type": "flush"}))

        feeder = asyncio.create_task(feed())
        first = None
        try:
            while first is None:
                message = await asyncio.wait_for(ws.recv(), 120)
                if isinstance(message, bytes):
                    first = time.perf_counter()
                elif json.loads(message)["type"] in ("error", "done"):
                    raise RuntimeError(f"no audio: {message}")
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        await ws.send(json.dumps({"type": "cancel"}))
        while True:  # the turn's done (audio of it may still be on its way)
            message = await asyncio.wait_for(ws.recv(), 120)
            if isinstance(message, str) and json.loads(message)["type"] == "done":
                break
        return Trial(first - t0)

    async def close(self) -> None:
        await self.ws.close()


# ----------------------------------------------------------------------------- the runs
def plan_rates(voice: PreparedVoice, path: str, args: argparse.Namespace) -> list[float]:
    """Every rate on the engine path; in-context clones' long waits only at `--icl-rate` elsewhere."""
    if path == "engine" or voice.case.kind != "icl" or args.icl_rate is None:
        return args.rates
    return [args.icl_rate]


async def run_model(spec: str, args: argparse.Namespace, report: dict[str, Any]) -> list[Cell]:
    from qwen3tts_agent.models.loading import load_official_model

    log(f"loading {spec} on {args.device}")
    official = load_official_model(spec, device=args.device, dtype=getattr(torch, args.dtype), progress=False)
    engine = Engine(official, max_streams=args.max_streams, max_seq_len=args.max_seq_len, prefix_cache=args.prefix_cache,
                    staged_prefill=args.staged_prefill, speculative_first_frame=args.speculative_first_frame,
                    backend=args.backend)
    server: InProcessServer | None = None
    cells: list[Cell] = []
    try:
        started = time.perf_counter()
        engine.warmup(progress=False)
        log(f"  warm-up {time.perf_counter() - started:.1f} s")
        kinds = {"base": ("xvector", "icl"), "custom_voice": ("customvoice",)}.get(engine.model_type, ())
        voices = [prepare_voice(engine, name, case) for name, case in VOICES.items()
                  if case.kind in kinds and name in args.voices]
        all_pieces = text_pieces(engine, REPLY)
        report.setdefault("voices", {})
        for v in voices:
            report["voices"][f"{spec}/{v.name}"] = {
                "reference_s": v.ref_seconds or None, "ref_text": v.ref_text, "needed_tokens": v.needed_tokens,
                "early_start": v.case.early_start,
            }
            if v.needed_tokens + MARGIN_TOKENS > len(all_pieces):
                raise ValueError(f"the reply ({len(all_pieces)} tokens) is shorter than {v.name}'s wait")
        if "ws" in args.paths:
            server = InProcessServer(engine, spec)
        have_pipecat = pipecat_available()
        seeds = itertools.count()

        def sampling() -> SamplingParams:
            return SamplingParams(seed=next(seeds), max_frames=args.frames, ignore_eos=True)

        for v in voices:
            pieces = all_pieces[: max(MIN_TOKENS, v.needed_tokens + MARGIN_TOKENS)]
            await engine_trial(engine, v, pieces, max(args.rates), sampling())  # the voice's first turn
            for path in args.paths:
                if path.startswith("pipecat") and not have_pipecat:
                    cells.append(Cell(spec, v.name, path, 0.0, error="pipecat is not installed"))
                    continue
                if path == "ws" and v.case.early_start:
                    cells.append(Cell(spec, v.name, path, 0.0, error="the server offers no early start"))
                    continue
                session = None
                if path == "ws":
                    assert server is not None
                    session = await WsSession.open(server.port, server.register(v.name, v), args.frames)
                try:
                    runs = args.icl_runs if v.case.kind == "icl" else args.runs
                    for rate in plan_rates(v, path, args):
                        cell = Cell(spec, v.name, path, rate)
                        cells.append(cell)
                        for i in range(runs + 1):  # the first run of a cell warms its path up, unmeasured
                            try:
                                if path == "engine":
                                    trial = await engine_trial(engine, v, pieces, rate, sampling())
                                elif path == "ws":
                                    assert session is not None
                                    trial = await session.trial(pieces, rate)
                                else:
                                    trial = await pipecat_trial(engine, v, pieces, rate, sampling(), path)
                            except Exception as exc:  # noqa: BLE001 - recorded in the report, the run goes on
                                cell.error = f"{type(exc).__name__}: {exc}"[:300]
                                log(f"  {v.name} {path} {rate:g}/s failed: {cell.error}")
                                break
                            if i:
                                cell.trials.append(trial)
                        log(f"  {spec} {v.name:20s} {path:17s} {rate:5g} tok/s: {summary_line(cell)}")
                finally:
                    if session is not None:
                        await session.close()
        stats = engine.stats()
        report.setdefault("speculation", {})[spec] = {
            "first_frames_speculated": stats.speculations, "misses": stats.speculation_misses,
        }
    finally:
        if server is not None:
            server.stop()
        engine.close()
    return cells


def pipecat_available() -> bool:
    try:
        import qwen3tts_agent.pipecat  # noqa: F401
    except ImportError:
        return False
    return True


def cell_summary(cell: Cell) -> dict[str, Any]:
    first = [1000 * t.first_audio_s for t in cell.trials]
    waits = [1000 * t.text_wait_s for t in cell.trials if t.text_wait_s is not None]
    after = [1000 * (t.first_audio_s - t.text_wait_s) for t in cell.trials if t.text_wait_s is not None]
    return {
        "model": cell.model, "voice": cell.voice, "path": cell.path, "tokens_per_s": cell.rate, "runs": len(first),
        "first_audio_ms": {"p50": pct(first, 50), "p95": pct(first, 95), "min": min(first, default=None),
                           "max": max(first, default=None)},
        "text_wait_ms_p50": pct(waits, 50),
        "first_audio_after_text_ms_p50": pct(after, 50),
        "error": cell.error,
    }


def summary_line(cell: Cell) -> str:
    s = cell_summary(cell)
    if s["runs"] == 0:
        return f"no result ({cell.error})"
    fa = s["first_audio_ms"]
    line = f"first audio p50 {fa['p50']:.1f} / p95 {fa['p95']:.1f} ms"
    if s["text_wait_ms_p50"] is not None:
        line += f"; text wait {s['text_wait_ms_p50']:.1f} ms, after it {s['first_audio_after_text_ms_p50']:.1f} ms"
    return line


def print_table(rows: list[dict[str, Any]], rates: list[float]) -> None:
    print("\nfirst audio from the first LLM token, p50 / p95 ms (text wait p50 ms in brackets)")
    header = f"{'model':26s} {'voice':20s} {'path':17s}" + "".join(f"{f'{r:g} tok/s':>24s}" for r in rates)
    print(header)
    keys = sorted({(r["model"], r["voice"], r["path"]) for r in rows}, key=lambda k: (k[0], list(VOICES).index(k[1]), PATHS.index(k[2])))
    for key in keys:
        line = f"{key[0]:26s} {key[1]:20s} {key[2]:17s}"
        for rate in rates:
            match = [r for r in rows if (r["model"], r["voice"], r["path"]) == key and r["tokens_per_s"] in (rate, 0.0)]
            if not match:
                cell = "-"
            elif match[0]["runs"] == 0:
                cell = "n/a"
            else:
                fa, wait = match[0]["first_audio_ms"], match[0]["text_wait_ms_p50"]
                cell = f"{fa['p50']:.1f} / {fa['p95']:.1f}" + (f" ({wait:.0f})" if wait is not None else "")
            line += f"{cell:>24s}"
        print(line)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "frames_per_utterance": args.frames,
        "prefix_cache": args.prefix_cache, "staged_prefill": args.staged_prefill,
        "speculative_first_frame": args.speculative_first_frame, "backend": args.backend, "reply": REPLY,
        "reference_texts": {str(k): v for k, v in REFERENCE_TEXTS.items()},
    }
    rows = []
    for spec in args.models:
        rows += [cell_summary(cell) for cell in await run_model(spec, args, report)]
    report["rows"] = rows
    print_table(rows, args.rates)
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    words = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--models", type=words, default=["synthetic:0.6b", "synthetic:0.6b-customvoice"],
                        help="checkpoints, comma-separated; Base models run the clones, CustomVoice ones a speaker")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--rates", type=floats, default=[30.0, 60.0, 100.0], help="LLM tokens per second")
    parser.add_argument("--icl-rate", type=float, default=60.0,
                        help="in-context clones wait for tens of tokens: off the engine path, time them at this rate only")
    parser.add_argument("--paths", type=words, default=list(PATHS), help=f"of {', '.join(PATHS)}")
    parser.add_argument("--voices", type=words, default=list(VOICES), help=f"of {', '.join(VOICES)}")
    parser.add_argument("--runs", type=int, default=5, help="measured turns per cell")
    parser.add_argument("--icl-runs", type=int, default=2, help="measured turns per in-context clone cell")
    parser.add_argument("--frames", type=int, default=8, help="fixed frames per utterance (80 ms each)")
    parser.add_argument("--max-streams", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false")
    parser.add_argument("--staged-prefill", action="store_true", help="Engine(staged_prefill=True), GPU only")
    parser.add_argument("--no-speculation", dest="speculative_first_frame", action="store_false",
                        help="Engine(speculative_first_frame=False): the first frame waits for its token to be final")
    parser.add_argument("--backend", default="auto", help="the engine's backend (auto: int8 on a CPU, torch on a GPU)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke settings: one rate, one run per cell")
    parser.add_argument("--out", type=Path, default=Path("turn_latency.json"))
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.quick:
        args.rates, args.icl_rate, args.runs, args.icl_runs, args.frames = [100.0], 100.0, 1, 1, 3
    unknown = set(args.paths) - set(PATHS) | set(args.voices) - set(VOICES)
    if unknown:
        parser.error(f"unknown paths or voices: {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(report, indent=2))
    log(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
