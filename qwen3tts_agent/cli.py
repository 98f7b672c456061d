"""Command line: `qwen3tts-agent say ...` streams speech to a WAV file; `qwen3tts-agent serve ...` runs the server;
`qwen3tts-agent serve-ray ...` runs it over many engine replicas on a Ray cluster."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from .caches import use_bytecode_cache
from .engine.frontend import AudioInput
from .engine.types import DEFAULT_CHUNK_SCHEDULE, SAMPLE_RATE, SamplingParams, TextLayout, Voice
from .errors import Qwen3TTSAgentError
from .reference import demo_reference

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-Base"
FRAMES_PER_CHARACTER = 0.9  # 12.5 frames/s over roughly 14 characters/s of English speech


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="hub id, local checkpoint folder, or synthetic:<tiny|0.6b|1.7b>[-<base|customvoice|voicedesign>]")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="float32 or bfloat16 (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "int8", "int4", "fp32"),
                        help="model maths: auto (int8 ONNX Runtime graphs on a CPU, PyTorch on a GPU), torch, int8, "
                             "int4 (4-bit weights: faster, coarser), fp32 (the CPU backend with fp32 weights); "
                             "see docs/cpu-backend.md")


def _add_say(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("say", help="stream speech for a text into a WAV file")
    p.add_argument("text")
    _add_model_args(p)
    p.add_argument("--out", default="out.wav", help="output WAV file (24 kHz mono)")
    p.add_argument("--voice", help="reference recording to clone (Base models)")
    p.add_argument("--ref-text", help="transcript of --voice (in-context cloning); without it only the speaker embedding is used")
    p.add_argument("--speaker", help="named speaker (CustomVoice models)")
    p.add_argument("--instruct", help="voice/style instruction (VoiceDesign; CustomVoice 1.7B)")
    p.add_argument("--language", default="auto")
    p.add_argument("--seed", type=int)
    p.add_argument("--greedy", action="store_true", help="deterministic decoding")
    p.add_argument("--max-frames", type=int,
                   help="cap at N x 80 ms of audio (default: the model's limit; for synthetic models, which never "
                        "stop by themselves, about the text's spoken length)")
    p.add_argument("--chunk-schedule", default=",".join(map(str, DEFAULT_CHUNK_SCHEDULE)),
                   help="frames per streamed chunk, e.g. 1,2,4,8 (the last repeats)")
    p.add_argument("--stream-text", action="store_true", help="feed the text word by word, as an LLM would")
    p.set_defaults(func=_say)


def _say(args: argparse.Namespace) -> int:
    import soundfile as sf

    from .engine.frontend import Engine
    from .progress import Progress

    engine = Engine.load(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
    try:
        voice = Voice(speaker=args.speaker, instruct=args.instruct)
        if engine.model_type == "base":
            if args.voice:
                reference: AudioInput = args.voice
            else:
                print("no --voice given: cloning a built-in synthetic reference signal (pass --voice REF.wav for a real voice)")
                reference = demo_reference()
            prompt = engine.create_voice(reference, args.ref_text, x_vector_only=not args.ref_text)
            voice = Voice(prompt=prompt)
        elif engine.model_type == "custom_voice" and not args.speaker:
            voice = Voice(speaker=engine.speakers[0], instruct=args.instruct)
            print(f"no --speaker given: using {voice.speaker!r} (available: {', '.join(engine.speakers)})")
        max_frames = args.max_frames or SamplingParams.max_frames
        if args.max_frames is None and args.model.startswith("synthetic:"):
            max_frames = max(25, round(len(args.text) * FRAMES_PER_CHARACTER))
            print(f"synthetic model: random weights never end an utterance, so it is capped at {max_frames} frames")
        sampling = SamplingParams(seed=args.seed, max_frames=max_frames)
        if args.greedy:
            sampling = SamplingParams.greedy(seed=args.seed, max_frames=max_frames)
        schedule = tuple(int(n) for n in args.chunk_schedule.split(","))
        stream = engine.open_stream(
            None if args.stream_text else args.text, voice=voice, language=args.language,
            sampling=sampling, chunk_schedule=schedule, text_layout=TextLayout.INTERLEAVED,
        )
        if args.stream_text:
            for word in args.text.split(" "):
                stream.push_text(word + " ")
            stream.close_input()
        with sf.SoundFile(args.out, "w", samplerate=SAMPLE_RATE, channels=1, subtype="PCM_16") as wav, \
                Progress("speaking", unit="s audio", bar_format="{desc}: {n:.2f}{unit} [{elapsed}]") as bar:
            for chunk in stream.chunks():
                wav.write(chunk.pcm)
                bar.update(chunk.duration)
        result = stream.result
        print(f"wrote {args.out}: {result.audio_seconds:.2f} s of audio, {result.frames} frames ({result.finish_reason})")
        print(f"first audio: {1000 * (result.first_audio_latency or 0):.1f} ms   "
              f"real-time factor: {result.real_time_factor:.2f}x (audio s / wall s)   device: {engine.device}, "
              f"backend: {engine.backend}")
        return 0
    finally:
        engine.close()


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="do a start's slow work ahead of time (container images, before a restart): fetch the weights, "
             "convert them for a CPU backend, compile every GPU kernel into Triton's disk cache",
    )
    _add_model_args(p)
    p.add_argument("--max-streams", default="auto",
                   help="engine stream slots, as `serve` will be given them (the GPU kernels compiled depend on it)")
    p.add_argument("--max-seq-len", type=int,
                   help="positions a stream slot holds, as `serve --max-seq-len` will be given them (likewise)")
    p.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    """Load the model and warm an engine up as `serve` would, so that what a start can keep on disk is there.

    On a CPU backend that is the converted weights (beside the checkpoint, or the user cache when its folder is
    read-only); on a GPU, Triton's compiled kernels (`TRITON_CACHE_DIR`, default ~/.triton/cache: point it into
    the image to bake them in). CUDA graphs belong to a process: every start captures its own.
    """
    from .engine.frontend import Engine

    max_streams: int | str = "auto" if args.max_streams == "auto" else int(args.max_streams)
    started = time.perf_counter()
    sized = {} if args.max_seq_len is None else {"max_seq_len": args.max_seq_len}
    engine = Engine.load(
        args.model, device=args.device, dtype=args.dtype, backend=args.backend, max_streams=max_streams, **sized
    )
    loaded = time.perf_counter()
    try:
        engine.warmup()
    finally:
        engine.close()
    warmed = time.perf_counter()
    print(f"{args.model} prepared on {engine.device} ({engine.backend} backend, {engine.info.max_streams} slots): "
          f"weights loaded in {loaded - started:.1f} s, warm-up in {warmed - loaded:.1f} s")
    from .backends import CPU_BACKENDS

    if engine.backend in CPU_BACKENDS:
        from .backends.cpu.store import conversion_folder

        print(f"{engine.backend} weights in {conversion_folder(engine.model, engine.backend)}")
    elif engine.device.type == "cuda":
        from triton import knobs

        print(f"compiled GPU kernels in {knobs.cache.dir} (TRITON_CACHE_DIR); CUDA graphs are captured at each start")
    else:
        print("the PyTorch backend on the CPU compiles nothing ahead of time: the weights are what was fetched")
    return 0


def _add_extra_command(sub: argparse._SubParsersAction, name: str, extra: str, help_text: str) -> None:
    """Add `name` from the extra's package (`qwen3tts_agent.<extra>.cli`, `add_<name>_command`); without the
    extra installed, a command that answers every invocation with the install hint."""
    try:
        cli = importlib.import_module(f"qwen3tts_agent.{extra}.cli")
    except ImportError as exc:
        missing = exc
        p = sub.add_parser(name, help=f"{help_text} (needs the [{extra}] extra)")
        # whatever options follow, the answer is the install hint, not argparse's "unrecognized arguments"
        p.set_defaults(func=lambda _a: _missing_extra(extra, missing), accepts_any_arguments=True)
        return
    getattr(cli, f"add_{name.replace('-', '_')}_command")(sub)


def _missing_extra(extra: str, exc: Exception) -> int:
    print(f'error: {exc}. Install it with: pip install "qwen3tts-agent[{extra}]"', file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    use_bytecode_cache()  # before the heavy imports: see caches.py
    parser = argparse.ArgumentParser(prog="qwen3tts-agent", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_say(sub)
    _add_prepare(sub)
    _add_extra_command(sub, "serve", "server", "run the streaming server")
    _add_extra_command(sub, "serve-ray", "ray", "run the server over engine replicas on Ray")
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        return int(args.func(args) or 0)
    except Qwen3TTSAgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger(__name__).info("done in %.1f s", time.perf_counter() - started)


if __name__ == "__main__":
    raise SystemExit(main())
