"""`benchmarks/serving/load.py --held`: a held call asks for its next utterance once its listener has heard the last."""

from __future__ import annotations

import asyncio
import time

from benchmarks.serving.load import ClientPlan, Playback, Record, held_loop, mean_overlap

AUDIO_S = 0.3  # each fake utterance: this much audio, received at once


async def _received_at_once(plan: ClientPlan, record: Record) -> None:
    """A server far faster than real time: the whole utterance arrives at the request (played from then on)."""
    playback = Playback()
    playback.receive(time.monotonic(), int(AUDIO_S * 24_000))
    record.first_audio_s, record.done_s = 0.001, 0.001
    record.audio_s, record.played_until = playback.audio_s, playback.ends_at()


def _plan(*, back_to_back: bool, duration: float) -> ClientPlan:
    return ClientPlan(
        url="", transport="ws", rate=0.0, duration=duration, seed=0, voice=None, language="english", frames=4,
        api_key=None, start_at=time.monotonic(), held=1, back_to_back=back_to_back,
    )


def test_a_held_call_waits_for_its_playback_and_back_to_back_does_not() -> None:
    played = _plan(back_to_back=False, duration=1.0)
    asyncio.run(held_loop(played, _received_at_once, offset=0.0))
    starts = [r.started for r in played.records]
    # one request per utterance played: every next one once the last has played out
    assert len(starts) == 4, starts
    assert all(later - earlier >= AUDIO_S - 0.005 for earlier, later in zip(starts, starts[1:], strict=False))

    back_to_back = _plan(back_to_back=True, duration=0.05)
    asyncio.run(held_loop(back_to_back, _received_at_once, offset=0.0))
    assert len(back_to_back.records) > 10  # the next as soon as the audio is in


def test_playback_ends_after_its_audio_and_stalls() -> None:
    playback = Playback()
    assert playback.ends_at() is None
    playback.receive(10.0, 24_000)  # 1 s of audio at t=10
    playback.receive(11.5, 12_000)  # 0.5 s more, arriving 0.5 s after the first ran out
    assert playback.stall_s == 0.5
    assert playback.ends_at() == 10.0 + 1.5 + 0.5


def test_mean_overlap_counts_spans_open_in_the_window() -> None:
    assert mean_overlap([(0.0, 10.0), (5.0, 15.0), (20.0, 30.0)], (5.0, 15.0)) == 1.5
