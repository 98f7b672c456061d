"""Property-based tests of the WebSocket protocol: Hypothesis plays random clients against a real server.

Each example is a random sequence of valid and invalid messages (starts good and bad, text deltas including
whitespace-only and invalid Unicode, flushes, cancels, malformed JSON, unknown types, binary frames, pauses),
ending with a `close` or an abrupt disconnect. Whatever the sequence, the protocol's invariants hold:

- every `audio` header is followed at once by its binary frame;
- every utterance the server opened gets exactly one `done` (when the session ends with `close`), no audio
  after its `done`, and an `error` naming an utterance is followed by that utterance's `done`;
- after a `cancel` (as seen by the server's reply to the next message), no audio of the utterances it
  cancelled, and their `done` says `cancelled` unless it had arrived before (or their error had);
- afterwards nothing of the session is left in the server or the engine, and a fresh session is served.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed

from qwen3tts_agent import Engine
from tests.server_fixtures import (
    RunningServer,
    async_wait_for,
    listen,
    make_config,
    running_server,
    send_json,
    server_engine,  # noqa: F401  (fixture)
    start_session,
    ws_connect,
)

MAX_ENDS = 5  # flushes and cancels per example: utterances stay below the session's pending limit (8)
PROBE = '{"type": "probe"}'  # answered by an unknown_type error once every earlier message was handled

texts = st.one_of(
    st.text(st.sampled_from("abc xyz.,!?é"), min_size=1, max_size=12),
    st.sampled_from([" ", "\n\t", "  "]),  # whitespace-only pieces
)
bad_messages = st.sampled_from(
    [
        "{oops",
        "[" * 200 + "]" * 200,
        '{"type": "sing"}',
        '{"type": "text"}',
        '{"type": "text", "text": 5}',
        '{"type": "flush", "now": true}',
        '{"type": "text", "text": "bad \\ud800 text"}',
        "null",
        b"\x00binary",
    ]
)
valid_starts = st.builds(
    lambda frames, eos, seed: {"type": "start", "sampling": {"max_frames": frames, "ignore_eos": eos, "seed": seed}},
    st.integers(1, 4),
    st.booleans(),
    st.integers(0, 1000),
)
invalid_starts = st.sampled_from(
    [
        {"type": "start", "sampling": {"top_k": 1000}},  # beyond the engine's top_k_cap
        {"type": "start", "voice": "nobody"},
        {"type": "start", "sampling": {"max_frames": 0}},
    ]
)
# mostly a session that speaks (one_of would pick each branch about as often)
starts = st.integers(0, 9).flatmap(lambda n: invalid_starts if n == 0 else valid_starts)
noise = st.one_of(
    st.tuples(st.just("bad"), bad_messages),
    st.tuples(st.just("start"), starts),
    st.tuples(st.just("pause"), st.sampled_from([0.0, 0.01, 0.05])),
)
# An utterance's worth of actions: some text pieces, some noise among them, and how it ends (flush, cancel,
# or nothing: the next block's text joins it). At most MAX_ENDS blocks keep the session's pending utterances
# below its limit (8).
blocks = st.tuples(
    st.lists(st.tuples(st.just("text"), texts), min_size=1, max_size=4),
    st.lists(noise, max_size=2),
    st.sampled_from(["flush", "flush", "cancel", None]),
    st.randoms(use_true_random=False),
).map(lambda b: _shuffled(b[0] + b[1], b[3]) + ([(b[2], None)] if b[2] else []))
scripts = st.tuples(
    starts,
    st.lists(blocks, min_size=1, max_size=MAX_ENDS).map(lambda bs: [step for b in bs for step in b]),
    st.sampled_from(["close", "close", "disconnect"]),
)


def _shuffled(steps: list, rng: Any) -> list:
    rng.shuffle(steps)
    return steps


@dataclass
class Model:
    """What the server must do with the messages sent so far (it handles them in order)."""

    started: bool = False
    closing: bool = False
    input_open: bool = False
    opened: int = 0  # utterances the server opened: uids 1..opened

    def text(self, text: str) -> None:
        if self.started and not self.closing and text and not self.input_open:
            self.opened += 1
            self.input_open = True

    def flush(self) -> None:
        self.input_open = False


@dataclass
class Received:
    messages: list[Any] = field(default_factory=list)  # parsed JSON, or bytes for binary frames
    closed_code: int | None = None


async def read_all(ws: Any, into: Received) -> None:
    try:
        async for message in ws:
            into.messages.append(message if isinstance(message, bytes) else json.loads(message))
    except ConnectionClosed:
        pass
    if ws.close_code is not None:
        into.closed_code = ws.close_code


def check_invariants(received: Received, model: Model, probes: list[set[int]], *, complete: bool) -> None:
    """The protocol's promises, checked on everything the client received."""
    messages = received.messages
    done: dict[int, str] = {}
    audio_after: dict[int, int] = {}  # uid -> index of its last audio header
    errors_for: set[int] = set()  # utterances an error message named
    probe_replies = [i for i, m in enumerate(messages) if isinstance(m, dict) and "'probe'" in m.get("message", "")]
    for i, message in enumerate(messages):
        if isinstance(message, bytes):
            assert i > 0 and isinstance(messages[i - 1], dict) and messages[i - 1]["type"] == "audio", (
                "a binary frame without its audio header"
            )
            continue
        kind = message["type"]
        if kind == "audio":
            assert i + 1 < len(messages) or not complete, "an audio header at the very end"
            if i + 1 < len(messages):
                assert isinstance(messages[i + 1], bytes), "an audio header not followed by its binary frame"
            uid = message["utterance_id"]
            assert uid not in done, f"audio of utterance {uid} after its done"
            audio_after[uid] = i
        elif kind == "done":
            uid = message["utterance_id"]
            assert uid not in done, f"two done messages for utterance {uid}"
            done[uid] = message["finish_reason"]
        elif kind == "error" and "utterance_id" in message:
            uid = message["utterance_id"]
            errors_for.add(uid)
            assert message["code"] and uid not in done, message
            later = [m for m in messages[i:] if isinstance(m, dict) and m["type"] == "done" and m["utterance_id"] == uid]
            assert later or not complete, f"error for utterance {uid} without its done"
    for reply_at, cancelled in zip(probe_replies, probes, strict=False):
        for uid in cancelled:
            assert audio_after.get(uid, -1) < reply_at, f"audio of utterance {uid} after its cancel"
            done_at = next(
                (i for i, m in enumerate(messages) if isinstance(m, dict) and m["type"] == "done" and m["utterance_id"] == uid),
                None,
            )
            if done_at is not None and done_at > reply_at:
                # an utterance whose failure was already being reported keeps its error's done
                failed = uid in errors_for
                assert done[uid] == "cancelled" or (failed and done[uid] == "error"), (uid, done[uid])
    assert set(done) <= set(range(1, model.opened + 1)), (sorted(done), model.opened)
    if complete:
        assert sorted(done) == list(range(1, model.opened + 1)), f"done for {sorted(done)}, opened {model.opened}"
        assert received.closed_code in (1000, None)


async def play(server: RunningServer, script: tuple) -> None:
    first_start, steps, ending = script
    model = Model()
    received = Received()
    probes: list[set[int]] = []  # for each cancel: the utterances it cancels
    async with ws_connect(server) as ws:
        reader = asyncio.create_task(read_all(ws, received))
        try:
            for kind, value in [("start", first_start), *steps]:
                if kind == "pause":
                    await asyncio.sleep(value)
                elif kind == "start":
                    await send_json(ws, value)
                    valid = value.get("sampling", {}).get("max_frames", 1) >= 1 and "voice" not in value
                    valid = valid and value.get("sampling", {}).get("top_k", 1) <= 64
                    model.started = model.started or valid
                elif kind == "text":
                    await send_json(ws, {"type": "text", "text": value})
                    model.text(value)
                elif kind == "flush":
                    await send_json(ws, {"type": "flush"})
                    model.flush()
                elif kind == "cancel":
                    await send_json(ws, {"type": "cancel"})
                    await ws.send(PROBE)
                    if model.started:
                        probes.append(set(range(1, model.opened + 1)))
                        model.flush()
                    else:
                        probes.append(set())
                else:
                    await ws.send(value)
            if ending == "close":
                await send_json(ws, {"type": "close"})
                if model.started:
                    model.flush()
                    model.closing = True
                    await asyncio.wait_for(reader, 60)  # the server speaks everything, then closes
                else:
                    await asyncio.sleep(0.05)
            else:
                await asyncio.sleep(0.02)
                ws.transport.abort()
        finally:
            if not reader.done():
                await ws.close()
            await asyncio.gather(reader, return_exceptions=True)
    check_invariants(received, model, probes, complete=ending == "close" and model.started)
    audio = sum(isinstance(m, dict) and m["type"] == "audio" for m in received.messages)
    event(f"utterances opened: {model.opened if model.opened < 3 else '3 or more'}")
    event("audio received" if audio else "no audio")
    event(f"ending: {ending}, started: {model.started}")


@pytest.fixture(scope="module")
def server(server_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:  # noqa: F811
    with running_server(make_config(tmp_path_factory.mktemp("voices")), engine=server_engine) as srv:
        yield srv


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(script=scripts)
def test_random_clients_never_break_the_protocol(
    server: RunningServer, server_engine: Engine, script: tuple  # noqa: F811
) -> None:
    asyncio.run(play(server, script))

    async def afterwards() -> None:
        await async_wait_for(lambda: server.state.sessions == 0, 10, "the session to end")
        await async_wait_for(lambda: server_engine.stats().active_streams == 0, 10, "the engine to idle")
        async with ws_connect(server) as ws:  # and the server still serves a fresh session
            await start_session(ws, sampling={"max_frames": 2, "ignore_eos": True, "seed": 1})
            await send_json(ws, {"type": "text", "text": "Fresh."})
            await send_json(ws, {"type": "flush"})
            assert (await listen(ws, 1))[1].done["finish_reason"] == "max_frames"

    asyncio.run(afterwards())
