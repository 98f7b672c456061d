"""Qwen3TTSService in real Pipecat pipelines (pipecat.tests.utils.run_test) on the tiny synthetic model."""

from __future__ import annotations

import asyncio
import collections
import random
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import soxr
from pipecat.frames.frames import (
    AggregatedTextFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMAssistantPushAggregationFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.metrics.metrics import TTFAMetricsData, TTFBMetricsData, TTSUsageMetricsData
from pipecat.pipeline.worker import PipelineParams
from pipecat.services.tts_service import TextAggregationMode
from pipecat.tests.utils import SleepFrame, run_test
from pipecat.transcriptions.language import Language

from qwen3tts_agent import SAMPLE_RATE, Engine, SamplingParams, VoicePrompt
from qwen3tts_agent import pipecat as qwen3tts_pipecat
from qwen3tts_agent.errors import (
    EngineClosedError,
    UnknownVoiceError,
    UnsupportedFeatureError,
    UnsupportedLanguageError,
)
from qwen3tts_agent.pipecat import Qwen3TTSService, UtteranceReport
from qwen3tts_agent.reference import warmup_reference

ROOT = Path(__file__).resolve().parents[1]
SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz
TOKEN = TextAggregationMode.TOKEN
SENTENCE = TextAggregationMode.SENTENCE
CANCEL_BOUND_S = 0.5  # engine drops a cancelled request within this (one CPU frame step is ~20-40 ms)


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    engine = Engine.load("synthetic:tiny", device="cpu", progress=False)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def voice(engine: Engine) -> VoicePrompt:
    return engine.create_voice(warmup_reference(), "A reference voice.", x_vector_only=True)


def fixed(frames: int, seed: int = 1) -> SamplingParams:
    """Exactly `frames` frames: the random tiny model's end token would make lengths arbitrary."""
    return SamplingParams(max_frames=frames, ignore_eos=True, seed=seed)


def make_tts(
    engine: Engine, voice: VoicePrompt, frames: int, mode: TextAggregationMode = SENTENCE, **kwargs: object
) -> tuple[Qwen3TTSService, list[UtteranceReport]]:
    settings = kwargs.pop("settings", None) or Qwen3TTSService.Settings(voice="ref", sampling=fixed(frames))
    tts = Qwen3TTSService(
        engine=engine, voices={"ref": voice}, settings=settings, text_aggregation_mode=mode, **kwargs
    )
    reports: list[UtteranceReport] = []

    @tts.event_handler("on_utterance_finished")
    async def on_utterance_finished(service: Qwen3TTSService, report: UtteranceReport) -> None:
        reports.append(report)

    return tts, reports


def audio(frames: Sequence[Frame], context_id: str | None = None) -> np.ndarray:
    chunks = [
        np.frombuffer(f.audio, dtype=np.int16)
        for f in frames
        if isinstance(f, TTSAudioRawFrame) and context_id in (None, f.context_id)
    ]
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2)))


def llm_turn(*deltas: str | SleepFrame) -> list[Frame]:
    return [
        LLMFullResponseStartFrame(),
        *(LLMTextFrame(d) if isinstance(d, str) else d for d in deltas),
        LLMFullResponseEndFrame(),
    ]


async def test_speak_frame_order_and_audio(engine: Engine, voice: VoicePrompt) -> None:
    tts, reports = make_tts(engine, voice, frames=12)
    down, up = await run_test(
        tts,
        frames_to_send=[TTSSpeakFrame("Hello there, how are you today?")],
        expected_down_frames=[
            AggregatedTextFrame,
            TTSStartedFrame,
            *[TTSAudioRawFrame] * 4,  # default chunk schedule 1, 2, 4, 8 frames: 12 = 1 + 2 + 4 + 5
            TTSTextFrame,
            LLMAssistantPushAggregationFrame,
            TTSStoppedFrame,
        ],
    )
    chunks = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert [len(f.audio) // 2 for f in chunks] == [n * SAMPLES_PER_FRAME for n in (1, 2, 4, 5)]
    assert {f.sample_rate for f in chunks} == {SAMPLE_RATE}
    assert (
        len(
            {
                f.context_id
                for f in down
                if isinstance(f, (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame))
            }
        )
        == 1
    )
    assert rms(audio(down)) > 300  # int16: clearly not silence
    [report] = reports
    assert report.result.frames == 12 and report.result.finish_reason == "max_frames"
    assert report.text == "Hello there, how are you today?"
    assert not up


async def test_token_mode_streams_a_turn_into_one_engine_stream(engine: Engine, voice: VoicePrompt) -> None:
    tts, reports = make_tts(engine, voice, frames=40, mode=TOKEN)
    deltas = ["Hello there, ", "how are you? ", "I am fine. ", "Thanks for asking."]
    started = engine.stats().streams_started
    down, _ = await run_test(tts, frames_to_send=llm_turn(deltas[0], SleepFrame(0.8), *deltas[1:]))
    assert engine.stats().streams_started - started == 1
    [report] = reports
    assert report.text == "".join(deltas)
    # Speech started on the first words, before the rest of the reply was even sent.
    assert report.first_audio is not None and report.first_audio < 0.8
    kinds = [type(f) for f in down]
    start, stop = kinds.index(TTSStartedFrame), kinds.index(TTSStoppedFrame)
    assert kinds.count(TTSStartedFrame) == kinds.count(TTSStoppedFrame) == 1
    assert all(start < i < stop for i, k in enumerate(kinds) if k is TTSAudioRawFrame)
    assert kinds.index(LLMFullResponseEndFrame) > stop
    assert len(audio(down)) == 40 * SAMPLES_PER_FRAME
    assert rms(audio(down)) > 300


@pytest.mark.parametrize("early_start", [False, True])
async def test_icl_early_start_setting_starts_a_token_mode_turn_on_its_first_words(
    engine: Engine, early_start: bool
) -> None:
    """An in-context clone's first frame needs text covering its 2 s reference (~20 tokens); the setting
    (`Voice.icl_early_start`) starts it on the first words instead."""
    clone = engine.create_voice(warmup_reference(), "A reference voice.")
    settings = Qwen3TTSService.Settings(voice="ref", sampling=fixed(6), icl_early_start=early_start)
    tts, reports = make_tts(engine, clone, frames=6, mode=TOKEN, settings=settings)
    await run_test(tts, frames_to_send=llm_turn("Hello there, ", "how are ", SleepFrame(1.0), "you today?"))
    [report] = reports
    assert report.result.frames == 6
    if early_start:
        assert report.first_audio < 1.0 and report.result.text_wait < 0.5
    else:  # a few words cover too little: it speaks once the turn's text is complete
        assert report.first_audio >= 1.0 and report.result.text_wait >= 0.9


async def test_sentence_mode_speaks_each_sentence(engine: Engine, voice: VoicePrompt) -> None:
    tts, reports = make_tts(engine, voice, frames=6)
    down, _ = await run_test(tts, frames_to_send=llm_turn("Hello there. ", "How are ", "you today?"))
    assert [r.text for r in reports] == ["Hello there.", "How are you today?"]
    kinds = [type(f) for f in down]
    assert kinds.count(TTSStartedFrame) == kinds.count(TTSStoppedFrame) == 1  # one turn, one audio context
    # Each sentence's text follows its audio, so an interruption keeps unheard text out of the context.
    texts = [i for i, k in enumerate(kinds) if k is TTSTextFrame]
    audio_at = [i for i, k in enumerate(kinds) if k is TTSAudioRawFrame]
    assert len(texts) == 2 and sum(i < texts[0] for i in audio_at) == len(audio_at) // 2
    assert len(audio(down)) == 2 * 6 * SAMPLES_PER_FRAME


async def test_resampling_is_continuous_across_chunks(engine: Engine, voice: VoicePrompt) -> None:
    text = [TTSSpeakFrame("Resample me, please.")]
    tts, _ = make_tts(engine, voice, frames=15)
    native, _ = await run_test(tts, frames_to_send=text)
    tts, _ = make_tts(engine, voice, frames=15, sample_rate=16000)
    resampled, _ = await run_test(tts, frames_to_send=text)
    assert {f.sample_rate for f in resampled if isinstance(f, TTSAudioRawFrame)} == {16000}
    streamed = audio(resampled)
    # Same seed, same audio: the stream must match resampling the whole utterance at once. Resampling
    # each chunk on its own differs by thousands at every chunk join (clicks).
    whole = soxr.resample(audio(native), SAMPLE_RATE, 16000, quality="VHQ")
    assert len(streamed) == len(whole) == 15 * SAMPLES_PER_FRAME * 2 // 3
    assert np.abs(streamed.astype(np.int32) - whole).max() <= 4


@pytest.mark.parametrize("mode", [TOKEN, SENTENCE])
async def test_interruption_stops_audio_and_engine(
    engine: Engine, voice: VoicePrompt, mode: TextAggregationMode
) -> None:
    # One frame per chunk, so every frame the engine generates is counted in its stream's result.
    tts, reports = make_tts(engine, voice, frames=1000, mode=mode, chunk_schedule=(1,))
    before = engine.stats()
    down, _ = await run_test(
        tts,
        frames_to_send=[
            TTSSpeakFrame("This is a very long answer that the caller will talk over."),
            SleepFrame(0.5),
            InterruptionFrame(),
            SleepFrame(0.3),
            TTSUpdateSettingsFrame(delta=Qwen3TTSService.Settings(sampling=fixed(6))),
            TTSSpeakFrame("Next turn."),
        ],
    )
    after = engine.stats()
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    first, second = (f.context_id for f in down if isinstance(f, TTSStartedFrame))
    assert len(audio(down[:cut], first)) > 0, "the interruption came mid-utterance"
    assert not [f for f in down[cut:] if getattr(f, "context_id", None) == first]
    interrupted, nxt = reports
    assert interrupted.context_id == first and interrupted.result.finish_reason == "cancelled"
    assert 0 < interrupted.result.frames < 1000
    assert (
        interrupted.result.cancel_latency is not None and interrupted.result.cancel_latency < CANCEL_BOUND_S
    )
    # The engine generated nothing beyond what the two streams report: it stopped stepping the first.
    assert after.frames_generated - before.frames_generated == interrupted.result.frames + nxt.result.frames
    assert after.cancels - before.cancels == 1
    # The next turn starts clean and plays whole.
    assert nxt.result.frames == 6 and len(audio(down[cut:], second)) == 6 * SAMPLES_PER_FRAME
    playback = [
        type(f) for f in down[cut:] if isinstance(f, (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame))
    ]
    assert playback[0] is TTSStartedFrame and playback[-1] is TTSStoppedFrame


async def test_a_barge_in_the_engine_cannot_take_yet_is_reported_after_a_bound(
    engine: Engine, voice: VoicePrompt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupted utterance's report waits for the engine to drop the stream, at most `TEARDOWN_WAIT_S`: with
    the engine's loop held up (a call on its own thread) it goes out after that bound rather than when (if ever)
    the engine comes back."""
    monkeypatch.setattr(qwen3tts_pipecat, "TEARDOWN_WAIT_S", 0.3)
    tts, reports = make_tts(engine, voice, frames=1000, chunk_schedule=(1,))
    release = threading.Event()
    held: list[Future[object]] = []
    hold = threading.Timer(0.25, lambda: held.append(engine.core.call(lambda: release.wait(3.0))))
    hold.start()
    try:
        await run_test(
            tts,
            frames_to_send=[
                TTSSpeakFrame("This is a very long answer that the caller will talk over."),
                SleepFrame(0.5),  # the engine's loop held from 0.25 s on, for 3 s
                InterruptionFrame(),
                SleepFrame(1.0),
            ],
        )
        # within the run, long before the 3 s: the engine has not ended the stream, so its reason is not known yet
        assert [(r.result.finish_reason, r.result.cancel_latency) for r in reports] == [(None, None)]
        assert not release.is_set() and held and not held[0].done()
    finally:
        hold.cancel()
        release.set()
        for call in held:
            call.result(timeout=10)


@pytest.mark.parametrize(("mode", "seed"), [(TOKEN, 1), (SENTENCE, 2)])
async def test_randomized_barge_ins_never_leak_audio_of_an_interrupted_turn(
    engine: Engine, voice: VoicePrompt, mode: TextAggregationMode, seed: int
) -> None:
    """500 turns per mode, each cut short at a random moment: before its stream opens, before its first
    audio, mid-audio, or after it ended. No audio frame of a turn may follow the InterruptionFrame that
    interrupted it (the first one after the turn's audio context appeared downstream).

    A turn is told apart by its audio context: an InterruptionFrame is a system frame and may overtake the
    data frames sent just before it, which Pipecat then treats as the start of the next turn.
    """
    turns = 500
    rng = random.Random(seed)
    # One frame per chunk, so every frame the engine makes is an audio frame the pipeline could leak.
    tts, reports = make_tts(engine, voice, frames=1000, mode=mode, chunk_schedule=(1,))
    frames: list[Frame] = []
    for turn in range(turns):
        if rng.random() < 0.5:
            frames.append(TTSSpeakFrame(f"Turn {turn} speaks. Turn {turn} goes on."))
        else:  # an LLM reply streaming in, cut at a random point
            deltas = [f"Turn {turn} ", "says ", "hello. ", f"Turn {turn} ", "adds more."]
            frames.append(LLMFullResponseStartFrame())
            for delta in deltas[: rng.randint(1, len(deltas))]:
                frames += [LLMTextFrame(delta), SleepFrame(rng.choice([0.0, 0.005]))]
        frames += [SleepFrame(rng.choice([0.0, 0.01, 0.05, 0.1, 0.15])), InterruptionFrame()]
    frames.append(SleepFrame(0.3))
    before = engine.stats()
    down, _ = await run_test(tts, frames_to_send=frames)

    assert sum(isinstance(f, InterruptionFrame) for f in down) == turns
    interrupted: set[str] = set()  # audio contexts an InterruptionFrame has passed since they appeared
    seen: set[str] = set()
    audio_of: collections.Counter[str] = collections.Counter()
    for frame in down:
        if isinstance(frame, InterruptionFrame):
            interrupted |= seen
        context = getattr(frame, "context_id", None)
        if context is None:
            continue
        seen.add(context)
        if isinstance(frame, TTSAudioRawFrame):
            assert context not in interrupted, f"audio of context {context} after its InterruptionFrame"
            audio_of[context] += 1
    # Every stream that made audio was reported, and the randomness reached every case: turns cut before
    # any audio, and turns cut mid-speech.
    assert set(audio_of) <= {r.context_id for r in reports}
    assert turns / 10 < len(audio_of) < turns - turns / 10
    await asyncio.sleep(0.2)
    after = engine.stats()
    assert after.active_streams == 0 and after.queued_streams == 0
    # The engine stopped stepping every interrupted stream: it made no frame that no stream reports.
    assert after.frames_generated - before.frames_generated == sum(r.result.frames for r in reports)


async def test_two_services_share_one_engine(engine: Engine, voice: VoicePrompt) -> None:
    (tts_a, reports_a), (tts_b, reports_b) = (
        make_tts(engine, voice, 30),
        make_tts(engine, voice, 30, mode=TOKEN),
    )
    most_active = 0

    async def watch() -> None:
        nonlocal most_active
        while True:
            most_active = max(most_active, engine.stats().active_streams)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    (down_a, _), (down_b, _) = await asyncio.gather(
        run_test(tts_a, frames_to_send=[TTSSpeakFrame("Session A speaking.")]),
        run_test(tts_b, frames_to_send=llm_turn("Session B ", "speaking at the same time.")),
    )
    watcher.cancel()
    assert most_active >= 2, "both sessions were stepped in one batch"
    assert len(audio(down_a)) == len(audio(down_b)) == 30 * SAMPLES_PER_FRAME
    assert [r.text for r in reports_a + reports_b] == [
        "Session A speaking.",
        "Session B speaking at the same time.",
    ]


async def test_settings_update_applies_from_the_next_utterance(engine: Engine, voice: VoicePrompt) -> None:
    tts, reports = make_tts(engine, voice, frames=5)
    update = Qwen3TTSService.Settings(language=Language.FR, sampling=fixed(7))
    down, _ = await run_test(
        tts,
        frames_to_send=[
            TTSSpeakFrame("Same text."),
            TTSSpeakFrame("Same text."),
            TTSUpdateSettingsFrame(delta=update),
            TTSSpeakFrame("Same text."),
        ],
    )
    first, second, third = (audio(down, f.context_id) for f in down if isinstance(f, TTSStartedFrame))
    assert np.array_equal(first, second)  # same settings and seed: same audio
    assert len(third) == 7 * SAMPLES_PER_FRAME  # new sampling
    assert not np.array_equal(third[: len(first)], first)  # new language
    assert [r.result.frames for r in reports] == [5, 5, 7]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (Qwen3TTSService.Settings(voice="nobody"), UnknownVoiceError),
        (Qwen3TTSService.Settings(language=Language.AR), UnsupportedLanguageError),
        (Qwen3TTSService.Settings(speaker="vivian"), UnsupportedFeatureError),  # Base models clone voices
    ],
)
async def test_bad_settings_become_error_frames(
    engine: Engine, voice: VoicePrompt, bad: Qwen3TTSService.Settings, error: type[Exception]
) -> None:
    tts, reports = make_tts(engine, voice, frames=4)
    fix = Qwen3TTSService.Settings(voice="ref", language="auto", speaker=None)
    down, up = await run_test(
        tts,
        frames_to_send=[
            TTSUpdateSettingsFrame(delta=bad),
            TTSSpeakFrame("This fails."),
            TTSUpdateSettingsFrame(delta=fix),
            TTSSpeakFrame("This works."),
        ],
    )
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert errors and isinstance(errors[0].exception, error)
    # The pipeline kept running and the corrected settings speak.
    assert [r.text for r in reports] == ["This works."]
    assert len(audio(down)) == 4 * SAMPLES_PER_FRAME


async def test_engine_failure_mid_stream_becomes_error_frame(voice: VoicePrompt) -> None:
    """The engine closes once the first audio has left the service (not a count of frames: on a busy machine
    the codec's thread may not have decoded a chunk yet): the audio before stays, the utterance ends in an
    ErrorFrame, and TTSStoppedFrame follows the audio."""
    engine = Engine.load("synthetic:tiny", device="cpu", progress=False)
    tts, reports = make_tts(engine, voice, frames=1000, mode=TOKEN)
    audio_out = asyncio.Event()
    push_frame = tts.push_frame

    async def spy(frame, *args, **kwargs):  # type: ignore[no-untyped-def]  # pass-through: notes the first audio
        await push_frame(frame, *args, **kwargs)
        if isinstance(frame, TTSAudioRawFrame):
            audio_out.set()

    tts.push_frame = spy  # type: ignore[method-assign]

    async def close_engine_mid_stream() -> None:
        await asyncio.wait_for(audio_out.wait(), 120)
        await asyncio.to_thread(engine.close)

    closer = asyncio.create_task(close_engine_mid_stream())
    down, up = await run_test(
        tts, frames_to_send=llm_turn("A long reply ", "that will not finish.", SleepFrame(1.0))
    )
    await closer
    [error] = [f for f in up if isinstance(f, ErrorFrame)]
    assert isinstance(error.exception, EngineClosedError)
    [report] = reports
    assert report.result.finish_reason == "error" and 0 < len(audio(down)) < 1000 * SAMPLES_PER_FRAME
    kinds = [type(f) for f in down]
    assert kinds.index(TTSStoppedFrame) > max(i for i, k in enumerate(kinds) if k is TTSAudioRawFrame)


async def test_metrics(engine: Engine, voice: VoicePrompt) -> None:
    tts, reports = make_tts(engine, voice, frames=8, mode=TOKEN)
    deltas = ["Measure ", "my latency."]
    down, _ = await run_test(
        tts,
        frames_to_send=llm_turn(*deltas),
        pipeline_params=PipelineParams(enable_metrics=True, enable_usage_metrics=True),
    )
    assert tts.can_generate_metrics()
    data = [d for f in down if isinstance(f, MetricsFrame) for d in f.data]
    [ttfb] = [d for d in data if isinstance(d, TTFBMetricsData) and d.value > 0]
    [ttfa] = [d for d in data if isinstance(d, TTFAMetricsData)]
    [usage] = [d for d in data if isinstance(d, TTSUsageMetricsData)]
    assert 0 < ttfb.value <= ttfa.ttfa < 5
    assert usage.value == len("".join(deltas))
    assert reports[0].first_audio is not None and reports[0].first_audio < 5


def test_missing_pipecat_names_the_extra() -> None:
    code = "import sys; sys.modules['pipecat'] = None; import qwen3tts_agent.pipecat"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert 'pip install "qwen3tts-agent[pipecat]"' in proc.stderr


def test_a_bot_that_uses_a_core_process_loads_no_torch() -> None:
    """With an `EngineClient` of a core in another process, the bot's process needs no torch (seconds to
    import, hundreds of MB): the service module and the client import none until an `Engine` is asked for."""
    code = (
        "import sys, qwen3tts_agent.pipecat, qwen3tts_agent.engine.process.client; "
        "print(sorted(m for m in ('torch', 'transformers', 'qwen_tts') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]
