"""A Pipecat voice bot on WebRTC (aiortc) that speaks with qwen3tts-agent and stops talking when you do.

    python examples/pipecat_webrtc_bot.py -t webrtc          # then open http://localhost:7860/client/

Silero VAD does turn-taking and barge-in. The TTS runs in TOKEN mode by default: the reply's text deltas
stream into one engine stream per turn, so speech starts on the LLM's first tokens. An in-context clone
(--ref-audio with --ref-text) cannot start before the text covers its reference's span (tens of tokens), so
for it the bot speaks sentence by sentence instead (SENTENCE mode: the first sentence, once complete, starts
at once), unless --icl-early-start is given (see docs/pipecat.md). Every session in the process shares one
engine (one set of weights).

With an LLM configured (any OpenAI-compatible endpoint) the bot transcribes the caller with the
endpoint's transcription API and answers with its chat API:

    LLM_BASE_URL=http://localhost:8000/v1 LLM_MODEL=my-model [LLM_API_KEY=...] [STT_MODEL=whisper-1] \
        [STT_BASE_URL=...] python examples/pipecat_webrtc_bot.py -t webrtc

Without one it runs offline with no keys: there is no speech recognition then, so a scripted responder
answers each user turn (end of speech) with the next line of a script.

Voice options: --model (hub id, local folder or synthetic:*), --speaker (CustomVoice), --instruct
(VoiceDesign / 1.7B CustomVoice), --ref-audio/--ref-text (voice cloning with Base models).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

from loguru import logger
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    Frame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.runner.types import SmallWebRTCRunnerArguments
from pipecat.services.tts_service import TextAggregationMode
from pipecat.transports.base_transport import TransportParams
from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
from pipecat.turns.user_start import VADUserTurnStartStrategy
from pipecat.turns.user_stop import SpeechTimeoutUserTurnStopStrategy
from pipecat.turns.user_turn_processor import UserTurnProcessor
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.workers.runner import WorkerRunner

from qwen3tts_agent import Engine, SamplingParams, VoicePrompt
from qwen3tts_agent.pipecat import Qwen3TTSService

SCRIPT = [
    "Hello, I am a streaming voice bot. Talk over me whenever you like, and I will stop to listen.",
    "I heard you. My words are generated frame by frame, so when you speak, I stop within a frame.",
    "Thanks for trying me out. This script repeats now, but an LLM can take my place at any time.",
]

SYSTEM_PROMPT = (
    "You are a friendly voice assistant. Your replies are spoken aloud: answer in one to three short "
    "sentences of plain text, with no lists, markup or emoji."
)


@dataclass
class SharedTTS:
    """What every session in the process shares: one engine, the voice it speaks with, the offline script."""

    engine: Engine
    voices: dict[str, VoicePrompt]
    settings: Qwen3TTSService.Settings
    aggregation: TextAggregationMode
    script: list[str]


SHARED: SharedTTS | None = None


class ScriptedResponder(FrameProcessor):
    """Stands in for STT + LLM offline: answers each user turn with the next line, streamed like LLM tokens."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self._lines = lines
        self._turns = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, UserStoppedSpeakingFrame) and direction == FrameDirection.DOWNSTREAM:
            line = self._lines[self._turns % len(self._lines)]
            self._turns += 1
            await self.push_frame(LLMFullResponseStartFrame())
            for token in re.findall(r"\S+\s*", line):
                await self.push_frame(LLMTextFrame(token))
            await self.push_frame(LLMFullResponseEndFrame())


def conversation(script: list[str]) -> tuple[list[FrameProcessor], list[FrameProcessor]]:
    """What goes before the TTS and after the audio output: STT + LLM when LLM_MODEL is set, else the script."""
    model = os.getenv("LLM_MODEL")
    if not model:
        logger.info("No LLM_MODEL set: answering with the offline script")
        turns = UserTurnStrategies(
            start=[VADUserTurnStartStrategy()],
            stop=[SpeechTimeoutUserTurnStopStrategy(wait_for_transcript=False)],
        )
        return [UserTurnProcessor(user_turn_strategies=turns), ScriptedResponder(script)], []
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import (
        LLMContextAggregatorPair,
        LLMUserAggregatorParams,
    )
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.services.openai.stt import OpenAISTTService

    base_url = os.getenv("LLM_BASE_URL")
    api_key = os.getenv("LLM_API_KEY", "none")
    stt = OpenAISTTService(
        api_key=os.getenv("STT_API_KEY", api_key),
        base_url=os.getenv("STT_BASE_URL", base_url),
        settings=OpenAISTTService.Settings(model=os.getenv("STT_MODEL", "whisper-1")),
    )
    llm = OpenAILLMService(
        api_key=api_key, base_url=base_url, settings=OpenAILLMService.Settings(model=model)
    )
    context = LLMContext(messages=[{"role": "system", "content": SYSTEM_PROMPT}])
    turns = UserTurnStrategies(start=[VADUserTurnStartStrategy()], stop=[SpeechTimeoutUserTurnStopStrategy()])
    aggregators = LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(user_turn_strategies=turns)
    )
    return [stt, aggregators.user(), llm], [aggregators.assistant()]


async def bot(runner_args: SmallWebRTCRunnerArguments) -> None:
    """One WebRTC session: the runner calls this for each browser (or aiortc) peer that connects."""
    assert SHARED is not None, "start the bot with `python examples/pipecat_webrtc_bot.py -t webrtc`"
    transport = SmallWebRTCTransport(
        webrtc_connection=runner_args.webrtc_connection,
        params=TransportParams(audio_in_enabled=True, audio_out_enabled=True),
    )
    tts = Qwen3TTSService(
        engine=SHARED.engine,
        voices=SHARED.voices,
        settings=SHARED.settings,
        text_aggregation_mode=SHARED.aggregation,
    )
    before_tts, after_output = conversation(SHARED.script)
    pipeline = Pipeline(
        [
            transport.input(),
            VADProcessor(vad_analyzer=SileroVADAnalyzer()),
            *before_tts,
            tts,
            transport.output(),
            *after_output,
        ]
    )
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(enable_metrics=True, enable_usage_metrics=True),
        idle_timeout_secs=runner_args.pipeline_idle_timeout_secs,
    )

    @transport.event_handler("on_client_disconnected")
    async def on_client_disconnected(transport: SmallWebRTCTransport, client: object) -> None:
        await worker.cancel()

    runner = WorkerRunner(handle_sigint=runner_args.handle_sigint)
    await runner.add_workers(worker)
    await runner.run()


def add_voice_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", help="hub id, folder or synthetic:*"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--speaker", help="CustomVoice speaker (default: the model's first)")
    parser.add_argument(
        "--instruct", help="speaking style (1.7B CustomVoice) or voice description (VoiceDesign)"
    )
    parser.add_argument("--ref-audio", help="reference recording to clone (Base models)")
    parser.add_argument("--ref-text", help="transcript of --ref-audio (without it only the timbre is cloned)")
    parser.add_argument(
        "--max-ref-seconds", type=float,
        help="keep only the reference's first whole sentences within this (a shorter wait for text)",
    )
    parser.add_argument(
        "--icl-early-start", action="store_true",
        help="an in-context clone starts on the first tokens (not the official prompt; see docs/pipecat.md)",
    )
    parser.add_argument(
        "--aggregation", choices=("auto", "token", "sentence"), default="auto",
        help="TTS text aggregation; auto: sentence for an in-context clone without --icl-early-start, else token",
    )
    parser.add_argument("--language", default="auto")
    parser.add_argument("--max-frames", type=int, help="cap each reply at this many 80 ms frames")
    parser.add_argument(
        "--script", type=Path, help="offline replies, one a line (default: a three-line script about the bot)"
    )


def load_shared_tts(args: argparse.Namespace) -> SharedTTS:
    """Load and warm the engine once, before serving, and build the voice every session uses."""
    engine = Engine.load(args.model, device=args.device)
    engine.warmup()
    voices: dict[str, VoicePrompt] = {}
    settings = Qwen3TTSService.Settings(
        language=args.language, instruct=args.instruct, icl_early_start=args.icl_early_start
    )
    in_context = False
    if engine.model_type == "base":
        if not args.ref_audio:
            raise SystemExit("a Base model clones a voice: pass --ref-audio (and --ref-text)")
        voices["ref"] = engine.create_voice(
            args.ref_audio, args.ref_text, x_vector_only=args.ref_text is None,
            max_ref_seconds=args.max_ref_seconds,
        )
        settings.voice = "ref"
        in_context = args.ref_text is not None
    elif engine.model_type == "custom_voice":
        settings.speaker = args.speaker or engine.speakers[0]
    if args.max_frames:
        settings.sampling = SamplingParams(max_frames=args.max_frames)
    # TOKEN mode starts on the LLM's first tokens, except for an in-context clone, whose first frame needs
    # text covering its reference: a complete first sentence (SENTENCE mode) usually comes sooner
    sentence = args.aggregation == "sentence" or (
        args.aggregation == "auto" and in_context and not args.icl_early_start
    )
    aggregation = TextAggregationMode.SENTENCE if sentence else TextAggregationMode.TOKEN
    logger.info(f"TTS text aggregation: {aggregation}")
    script = SCRIPT
    if args.script:
        script = [line.strip() for line in args.script.read_text().splitlines() if line.strip()]
        if not script:
            raise SystemExit(f"--script {args.script} has no lines to say")
    return SharedTTS(engine, voices, settings, aggregation, script)


if __name__ == "__main__":
    from pipecat.runner.run import main

    parser = argparse.ArgumentParser(
        description="Qwen3-TTS voice bot (Pipecat, WebRTC)",
        epilog="The Pipecat runner's options (-t webrtc, --host, --port, ...) are accepted too.",
    )
    add_voice_arguments(parser)
    # The engine loads and warms up once, before the runner serves the first session.
    SHARED = load_shared_tts(parser.parse_known_args()[0])
    main(parser)
