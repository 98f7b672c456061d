"""The CPU's codec thread (`engine/audio/pipeline.py`): on a CPU the codec's calls, slot set-ups included, run on a
thread of their own beside the frame steps, and give the codes and audio of the codec on the loop's thread
(`overlap_codec=False`); a decode that fails there fails its stream and the engine goes on. While the thread
is idle the int8 graphs borrow its cores, with the same codes; a step waits for a first chunk near its end."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from qwen3tts_agent import SamplingParams, TextLayout, Voice
from qwen3tts_agent.backends.cpu.runner import CpuRunner
from qwen3tts_agent.engine.audio.pipeline import (
    CODEC_GRAPH_MAX_FRAMES,
    CODEC_LANE_MAX_BATCH,
    AudioPipeline,
    CodecThread,
    codec_lane_buckets,
    codec_lane_frames,
    cpu_thread_split,
)
from qwen3tts_agent.engine.messages import PromptSpec
from qwen3tts_agent.engine.runner import split_frames
from qwen3tts_agent.engine.scheduler import ChunkPlan, PromptShape, RequestState
from tests.engine.audio.test_codec_streaming import tiny_decoder
from tests.engine_helpers import REF_TEXT, TEXT, engine_for, reference_audio, xvector_voice

CODEC_THREAD = "qwen3tts-codec"
TEXTS = [TEXT, "A second stream, beside the first.", "And a third one, after them."]


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The engine splits PyTorch's thread count between the frame steps and the codec: two, as on CI."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_cores_are_split_between_the_frame_steps_and_the_codec() -> None:
    assert cpu_thread_split(1) == (1, 0)  # one core cannot run both at once
    assert cpu_thread_split(2) == (1, 1)
    assert cpu_thread_split(16) == (12, 4)


def test_decodes_run_on_the_codec_thread_and_match_the_codec_on_the_loops_thread(
    two_threads: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: dict[bool, set[str]] = {True: set(), False: set()}
    runs: dict[bool, list[tuple[list[list[int]], np.ndarray]]] = {}
    for overlap in (True, False):
        engine = engine_for("synthetic:tiny", max_streams=2, overlap_codec=overlap)
        codec = engine.core.audio.codec
        for name in ("decode", "reset", "prime", "restore"):
            original = getattr(codec, name)

            def spy(*args, _original=original, _seen=calls[overlap], **kwargs):
                _seen.add(threading.current_thread().name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(codec, name, spy)
        try:
            # an in-context clone: its first stream primes the codec state with the reference codes, the
            # later ones restore it; two streams share the steps
            voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
            sampling = SamplingParams.greedy(max_frames=14, ignore_eos=True)
            streams = [engine.open_stream(text, voice=voice, sampling=sampling) for text in TEXTS[:2]]
            audio = [np.concatenate([chunk.pcm for chunk in stream.chunks(timeout=120)]) for stream in streams]
            third, result = engine.synthesize_blocking(TEXTS[2], voice=voice, sampling=sampling)
            runs[overlap] = [*((s.result.codes, a) for s, a in zip(streams, audio, strict=True)), (result.codes, third)]
        finally:
            engine.close()
    assert calls[True] and all(name.startswith(CODEC_THREAD) for name in calls[True])
    assert not any(name.startswith(CODEC_THREAD) for name in calls[False])
    for (codes, pcm), (codes_loop, pcm_loop) in zip(runs[True], runs[False], strict=True):
        assert len(codes) == 14 and codes == codes_loop
        np.testing.assert_allclose(pcm, pcm_loop, atol=1e-5)  # PyTorch's CPU kernels on 1 or 2 threads


def test_a_decode_that_fails_on_the_codec_thread_fails_its_stream_and_the_engine_goes_on(
    two_threads: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engine_for("synthetic:tiny", max_streams=2)
    try:
        codec = engine.core.audio.codec
        original = codec.decode
        failures = iter([True])

        def decode(*args, **kwargs):
            if next(failures, False):
                raise RuntimeError("a decode broke")
            return original(*args, **kwargs)

        monkeypatch.setattr(codec, "decode", decode)
        voice = Voice(prompt=engine.create_voice(reference_audio(), None, x_vector_only=True))
        sampling = SamplingParams(max_frames=4, ignore_eos=True)
        stream = engine.open_stream(TEXT, voice=voice, sampling=sampling)
        with pytest.raises(RuntimeError, match="a decode broke"):
            list(stream.chunks(timeout=60))
        pcm, result = engine.synthesize_blocking("Next turn.", voice=voice, sampling=sampling)
        assert result.frames == 4 and len(pcm) == 4 * 1920
        assert engine.stats().restarts == 0
    finally:
        engine.close()


def test_the_codec_thread_is_idle_once_every_call_it_was_given_has_returned() -> None:
    thread = CodecThread(1)
    try:
        assert thread.idle
        release = threading.Event()
        first = thread.submit(lambda: release.wait(10))
        second = thread.submit(lambda: None)
        assert not thread.idle
        release.set()
        second.result(timeout=10)
        assert first.done() and thread.idle
    finally:
        thread.close()


def test_the_graphs_borrow_the_codecs_cores_while_it_is_idle_with_the_same_codes(two_threads: None) -> None:
    """With two cores, the frame steps' graphs run on one thread and the codec on the other; while the codec's
    thread has nothing to do, each graph call runs on a second copy of its graph with both. The codes are the
    same as with the graphs kept on their one thread."""
    runs = {}
    for lend in (True, False):
        engine = engine_for("synthetic:tiny", max_streams=2, backend="int8")
        runner = engine.core.runner
        assert isinstance(runner, CpuRunner)
        if not lend:
            runner.lend_codec_cores(lambda: False)
        try:
            voice = Voice(prompt=engine.create_voice(reference_audio(), REF_TEXT))
            sampling = [SamplingParams(seed=seed, max_frames=16, ignore_eos=True) for seed in (1, 2)]
            alone = engine.synthesize_blocking(TEXT, voice=voice, sampling=sampling[0])[1].codes
            pair = [engine.open_stream(text, voice=voice, sampling=s) for text, s in zip(TEXTS[:2], sampling, strict=True)]
            for stream in pair:
                list(stream.chunks(timeout=120))
            runs[lend] = ([alone, *(s.result.codes for s in pair)], runner.spare_cores.lent, runner.spare_cores.calls)
        finally:
            engine.close()
    (codes, lent, calls), (kept_codes, kept_lent, kept_calls) = runs[True], runs[False]
    assert 0 < lent <= calls and kept_lent == 0 and kept_calls > 0
    assert codes == kept_codes
    assert codes[0] == codes[1] and codes[1] != codes[2]  # the same request alone and beside another; two seeds


def test_a_first_chunk_decoded_beside_a_step_goes_out_before_the_step_after_it(
    two_threads: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU a frame step holds the core's thread, and nothing is delivered while it runs. The first chunk
    decodes beside the second frame (just handed over: not waited for); when the third frame would start while
    that decode is near its end, the step waits for it, so the chunk leaves before the third frame instead of
    after it.

    Events, not durations, place the decode's end. The test used to sleep the decode so that it ended 0.05 s
    into the third frame's slot, inside the launcher's 0.1 s wait: a loaded CPU or a garbage collection that
    stalled the codec's thread a little longer made it miss that wait, and the engine then rightly went on
    without it (a flaky failure on CI). Here:
    - the second frame lasts `step_s`, and also until the decode has done its real work, however slow;
    - the decode's last `tail_s` starts only once the launcher, about to start the third frame, asks which first
      chunks to wait for (were that wait gone, once the third frame starts: the chunk then leaves after it);
    - the launcher then waits up to half a step, 0.5 s: the tail has 0.4 s to spare on a stalled thread.
    The later frames take only their own time."""
    step_s, tail_s = 1.0, 0.1
    engine = engine_for("synthetic:tiny", max_streams=1)
    near_end = threading.Event()  # the third frame is about to start: the first chunk's decode ends now
    try:
        runner, audio = engine.core.runner, engine.core.audio
        codec = audio.codec
        original_step, original_decode, original_wait = runner.frame_step, codec.decode, audio.wait_for_first_audio
        step_starts: list[float] = []
        decoded = threading.Event()  # the first chunk's codec work is done, all but its tail
        first = iter([True])

        def frame_step(*args, **kwargs):
            frame = len(step_starts)
            step_starts.append(time.perf_counter())
            if frame == 2:
                near_end.set()  # the third frame went without waiting for the chunk (it must not)
            if frame < 2:
                time.sleep(step_s)
            if frame == 1:
                decoded.wait(60)
            return original_step(*args, **kwargs)

        def decode(*args, **kwargs):
            pcm = original_decode(*args, **kwargs)
            if next(first, False):
                decoded.set()
                near_end.wait(60)
                time.sleep(tail_s)
            return pcm

        def wait_for_first_audio(timeout_s: float, older_than_s: float) -> bool:
            if len(step_starts) >= 2:  # called on the core's thread between frames: the second has run
                near_end.set()
            return original_wait(timeout_s, older_than_s)

        voice = xvector_voice(engine)
        monkeypatch.setattr(runner, "frame_step", frame_step)
        monkeypatch.setattr(codec, "decode", decode)
        monkeypatch.setattr(audio, "wait_for_first_audio", wait_for_first_audio)
        stream = engine.open_stream(TEXT, voice=voice, sampling=SamplingParams.greedy(max_frames=4, ignore_eos=True))
        chunks = list(stream.chunks(timeout=60))
        left = chunks[0].timings.ready  # when the core handed the first chunk out
        assert step_starts[1] < left < step_starts[2]
    finally:
        near_end.set()  # a decode still held must not keep the codec's thread from closing
        engine.close()


def test_a_step_waits_for_a_first_chunk_near_the_end_of_its_decode() -> None:
    """`AudioPipeline.wait_for_first_audio`: a stream's first chunk decoding on the codec's thread for longer
    than `older_than_s` is waited for, up to the timeout; a newer one, a later chunk or no thread: not at all."""
    audio = AudioPipeline(
        tiny_decoder(), device=torch.device("cpu"), max_streams=2, chunk_schedule=(1, 2), graphed=False, overlap=True,
        codec_threads=1,
    )
    release = threading.Event()
    original = audio.codec.decode

    def decode(slots, codes):
        release.wait(10)
        return original(slots, codes)

    audio.codec.decode = decode  # type: ignore[method-assign]
    try:
        request = RequestState("a", PromptShape(TextLayout.INTERLEAVED), (1, 2), submitted=0.0)
        audio.start("a", PromptSpec(language_id=None))

        def plan(index: int, frames: int) -> ChunkPlan:
            codes = np.zeros((frames, 16), dtype=np.int64)
            return ChunkPlan(request, codes, frame_start=0, index=index, is_last=False, planned_at=time.perf_counter())

        audio.enqueue([plan(1, 2)])  # a later chunk: never waited for
        audio.pump(time.perf_counter(), streams=1)
        assert audio.wait_for_first_audio(5.0, older_than_s=0.0) is False
        audio.enqueue([plan(0, 1)])
        audio.pump(time.perf_counter(), streams=1)
        assert audio.wait_for_first_audio(5.0, older_than_s=60.0) is False  # handed over just now: no wait
        started = time.perf_counter()
        assert audio.wait_for_first_audio(0.05, older_than_s=0.0) is False  # still decoding after the timeout
        assert time.perf_counter() - started >= 0.05
        threading.Timer(0.05, release.set).start()
        assert audio.wait_for_first_audio(10.0, older_than_s=0.0) is True  # done within it
        assert [p.index for p, _ in audio.finished()] == [1, 0]
    finally:
        release.set()
        audio.close()
    without_thread = AudioPipeline(
        tiny_decoder(), device=torch.device("cpu"), max_streams=2, chunk_schedule=(1, 2), graphed=False, overlap=False,
    )
    assert without_thread.wait_for_first_audio(5.0, older_than_s=0.0) is False


def test_the_codec_lanes_largest_call_is_bounded_whatever_the_streams_and_the_schedule() -> None:
    """A graphed codec-lane call decodes at most `CODEC_LANE_MAX_BATCH` chunks: its graphs (and their scratch rows)
    stop there however many streams the engine has, and fewer streams stop them sooner. Its chunk lengths stop at
    `CODEC_GRAPH_MAX_FRAMES` whatever the schedule (longer chunks go in pieces), and still cut any chunk up."""
    assert codec_lane_buckets(240) == [1, 2, 4, 8, 16, 32, CODEC_LANE_MAX_BATCH]
    assert codec_lane_buckets(512)[-1] == CODEC_LANE_MAX_BATCH
    assert codec_lane_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert codec_lane_buckets(1) == [1]
    assert codec_lane_frames((1, 2, 4, 8)) == (1, 2, 4, 8)
    assert codec_lane_frames((3, 12)) == (1, 2, 3, 4, 8, 12)
    assert codec_lane_frames((1, 2, 4, 8, 16, 64)) == (1, 2, 4, 8, CODEC_GRAPH_MAX_FRAMES)
    assert split_frames(64, codec_lane_frames((1, 2, 4, 8, 16, 64))) == [16] * 4
    for length in range(1, 65):
        assert sum(split_frames(length, codec_lane_frames((5, 40)))) == length
