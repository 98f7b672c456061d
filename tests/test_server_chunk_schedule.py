"""What a session's chunk schedule promises (docs/server.md, "Chunks"), through the real server, a real WebSocket
client and the tiny engine: `ready` says the schedule the session runs with and whether chunks may be cut short,
and the audio headers' frame ranges keep to what that promises (issue 42: `[3, 5]` came out 3, 2, 2, 5, 5, 5, 2
on a GPU, with no word of why)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from qwen3tts_agent import Engine
from qwen3tts_agent.engine.scheduler.requests import FRAME_SECONDS, URGENT_SLACK_S
from tests.engine_helpers import engine_for
from tests.server_fixtures import (
    make_config,
    recv_json,
    running_server,
    send_json,
    server_engine,  # noqa: F401  (fixture)
    start_session,
    ws_connect,
)

TEXT = "Hello there, this is what a chunk schedule promises."
FRAMES = 22
SAMPLING = {"max_frames": FRAMES, "ignore_eos": True, "seed": 3}
# A client's audio comes a delivery after the core sends it; two deliveries on a busy machine differ by up to this.
DELIVERY_JITTER_S = 0.1


def scheduled(schedule: list[int], k: int) -> int:
    return schedule[min(k, len(schedule) - 1)]


def exact_chunks(schedule: list[int], frames: int) -> list[int]:
    """The frames of each chunk of an utterance of `frames` that keeps to its schedule: the last holds what is left."""
    chunks: list[int] = []
    while sum(chunks) < frames:
        chunks.append(min(scheduled(schedule, len(chunks)), frames - sum(chunks)))
    return chunks


async def speak(server: Any, **start: Any) -> tuple[dict[str, Any], list[dict[str, Any]], list[float]]:
    """One utterance in a session of its own: `ready`, the audio headers and when each arrived."""
    async with ws_connect(server) as ws:
        ready = await start_session(ws, sampling=SAMPLING, **start)
        await send_json(ws, {"type": "text", "text": TEXT})
        await send_json(ws, {"type": "flush"})
        headers: list[dict[str, Any]] = []
        arrived: list[float] = []
        while True:
            msg = await recv_json(ws, 60)
            if msg["type"] == "done":
                break
            assert msg["type"] == "audio", msg
            arrived.append(time.perf_counter())
            assert isinstance(await ws.recv(), bytes)
            headers.append(msg)
    assert msg["finish_reason"] == "max_frames" and msg["metrics"]["frames"] == FRAMES
    assert headers[0]["frame_start"] == 0 and headers[-1]["frame_end"] == FRAMES and headers[-1]["is_last"]
    for before, after in zip(headers, headers[1:], strict=False):
        assert after["frame_start"] == before["frame_end"]  # contiguous
    return ready, headers, arrived


def frame_counts(headers: list[dict[str, Any]]) -> list[int]:
    return [h["frame_end"] - h["frame_start"] for h in headers]


async def test_chunks_keep_exactly_to_the_sessions_schedule_where_none_is_cut_short(
    server_engine: Engine, tmp_path: Path  # noqa: F811
) -> None:
    """The CPU engine has no deadline-aware chunking: every chunk but the last carries its scheduled frames."""
    with running_server(make_config(tmp_path), engine=server_engine) as server:
        for asked in ([3, 5], [1, 2, 4], None):
            ready, headers, _ = await speak(server, **({"chunk_schedule": asked} if asked else {}))
            schedule = asked or list(server_engine.chunk_schedule)  # the server's `--chunk-schedule`
            assert ready["chunk_schedule"] == schedule and ready["chunks_cut_short_when_late"] is False
            assert frame_counts(headers) == exact_chunks(schedule, FRAMES), (schedule, frame_counts(headers))
    assert exact_chunks([3, 5], FRAMES) == [3, 5, 5, 5, 4]


async def test_where_chunks_may_be_cut_short_only_a_listener_about_to_run_out_gets_a_shorter_one(tmp_path: Path) -> None:
    """Deadline-aware chunking, as on a GPU: the first step after the first chunk has left takes 0.3 s (a stall),
    so the listener is about to run out before the second chunk is full, and it goes with the frames made so
    far. Every chunk is at most its scheduled size, and every shorter one but the last went when the audio
    before it had (nearly) played."""
    engine = engine_for("synthetic:tiny", max_streams=2, adapt_chunks=True)
    runner, scheduler = engine.core.runner, engine.core.scheduler
    frame_step = runner.frame_step
    stalled: list[bool] = []

    def stall_once_after_first_audio(*args, **kwargs):  # type: ignore[no-untyped-def]  # on the core's thread
        if not stalled and any(r.first_audio is not None for r in scheduler.running.values()):
            stalled.append(True)
            time.sleep(0.3)
        return frame_step(*args, **kwargs)

    runner.frame_step = stall_once_after_first_audio  # type: ignore[method-assign]
    try:
        with running_server(make_config(tmp_path), engine=engine) as server:
            ready, headers, arrived = await speak(server, chunk_schedule=[2, 8])
    finally:
        engine.close()
    assert ready["chunk_schedule"] == [2, 8] and ready["chunks_cut_short_when_late"] is True
    counts = frame_counts(headers)
    assert stalled and counts[0] == 2, counts  # the first chunk is never cut short
    assert all(n <= scheduled([2, 8], k) for k, n in enumerate(counts)), counts
    assert counts[1] < 8 and len(counts) > 2, counts  # the stall cut the second short
    for k, header in enumerate(headers[:-1]):
        if counts[k] < scheduled([2, 8], k):  # needed within 40 ms of its arrival, give or take the deliveries
            needed = arrived[0] + header["frame_start"] * FRAME_SECONDS
            assert arrived[k] >= needed - URGENT_SLACK_S - DELIVERY_JITTER_S, (k, counts, arrived[k] - needed)

