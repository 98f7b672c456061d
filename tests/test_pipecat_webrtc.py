"""End to end: the example bot runs under Pipecat's runner and an aiortc peer talks to it over WebRTC.

The caller's speech is real speech from Debian's espeak-ng, the bot hears it through Silero VAD, answers
with the tiny synthetic model, and the caller talks over it. Measured: caller speech onset -> the bot's
audio stops arriving at the caller (the barge-in stop latency).
"""

from __future__ import annotations

import asyncio
import fractions
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
import aioice.ice
import av
import numpy as np
import pytest
import soundfile as sf
import soxr
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
BOT = ROOT / "examples" / "pipecat_webrtc_bot.py"
RATE = 48_000  # WebRTC audio (Opus) runs at 48 kHz in 20 ms frames
FRAME = RATE // 50
LOUD = 200.0  # int16 RMS of a 20 ms frame above which the bot is talking (its silence decodes to ~0)
# This much silence ends the bot's speech; shorter gaps are the model running behind real time.
QUIET_GAP = 0.8
# The bot's replies. The random tiny model never says its end token, so each sentence runs to the engine's
# runaway guard (25 frames + 8 a text token): the first reply is one sentence of some 90 tokens, ~700 frames
# that take seconds to generate even on a fast CPU, so the caller cuts in while the engine is generating it.
SCRIPT = [
    "This first answer is a single sentence that goes on for quite a while, because the caller is going to"
    " talk over it long before it ends, and the bot has to stop speaking at once, drop whatever audio it has"
    " not played yet, cancel the request inside the speech engine, and then listen to what the caller wants"
    " to say instead of carrying on with this very long and rather dull answer about nothing at all.",
    "I heard you. My words are generated frame by frame, so when you speak, I stop within a frame.",
]
MAX_FRAMES = 1000  # the reply's cap, above the first answer's runaway guard
CUT_IN_AFTER_S = 0.5
STOP_BOUND_S = 1.0  # barge-in: caller speech onset -> bot audio stops, on 2 shared CPU cores
REF_TEXT = "This is the voice the bot borrows for its answers."

# espeak-ng is a system package (docs/install.md). `make test` installs it when it runs as root with apt;
# CI sets QWEN3TTS_REQUIRE_SYSTEM_PACKAGES=1, so there its absence fails the test instead of skipping it.
pytestmark = pytest.mark.skipif(
    shutil.which("espeak-ng") is None and os.environ.get("QWEN3TTS_REQUIRE_SYSTEM_PACKAGES") != "1",
    reason="needs the system package espeak-ng for the caller's speech: sudo apt-get install espeak-ng",
)


def loopback_only(use_ipv4: bool = True, use_ipv6: bool = True) -> list[str]:
    """aioice leaves out 127.0.0.1 when gathering candidates; both peers use it to meet on loopback."""
    return ["127.0.0.1"]


def speak(text: str, path: Path) -> Path:
    assert shutil.which("espeak-ng"), (
        "the caller's speech comes from Debian's espeak-ng: apt-get install espeak-ng"
    )
    subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), text], check=True)
    return path


def speech_48k(path: Path) -> np.ndarray:
    """The utterance as int16 at 48 kHz, leading and trailing silence trimmed (so onset = first frame)."""
    wav, rate = sf.read(path, dtype="float32")
    voiced = np.flatnonzero(np.abs(wav) > 0.02)
    wav = soxr.resample(wav[voiced[0] : voiced[-1]], rate, RATE)
    return (np.clip(wav, -1, 1) * 32767).astype(np.int16)


class Microphone(MediaStreamTrack):
    """The caller's microphone: real-time 20 ms frames of silence, or of the speech queued with `say`."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue = np.zeros(0, np.int16)
        self._pts = 0
        self._t0: float | None = None
        self._onset_due = False
        self.onsets: list[float] = []  # when each utterance's first frame went out
        self.ends: list[float] = []  # when each utterance's last frame went out

    def say(self, pcm: np.ndarray) -> None:
        self._queue = np.concatenate([self._queue, pcm])
        self._onset_due = True

    async def recv(self) -> av.AudioFrame:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        delay = self._t0 + self._pts / RATE - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        talking = len(self._queue) > 0
        chunk, self._queue = self._queue[:FRAME], self._queue[FRAME:]
        now = time.perf_counter()
        if self._onset_due:
            self.onsets.append(now)
            self._onset_due = False
        if talking and not len(self._queue):
            self.ends.append(now)
        frame = av.AudioFrame.from_ndarray(
            np.pad(chunk, (0, FRAME - len(chunk)))[None, :], format="s16", layout="mono"
        )
        frame.sample_rate = RATE
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, RATE)
        self._pts += FRAME
        return frame


class Speaker:
    """The caller's loudspeaker: when each 20 ms of the bot's audio arrived, and how loud it was."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.levels: list[float] = []

    async def listen(self, track: MediaStreamTrack) -> None:
        while True:
            frame = await track.recv()
            pcm = frame.to_ndarray().astype(np.float64)
            self.times.append(time.perf_counter())
            self.levels.append(float(np.sqrt(np.mean(pcm**2))))

    def talking_since(self, since: float) -> float | None:
        """Start of the first loud frame at or after `since`."""
        return next(
            (t for t, lvl in zip(self.times, self.levels, strict=True) if t >= since and lvl > LOUD), None
        )

    def stopped_after(self, since: float) -> float | None:
        """Last loud frame after `since` that is followed by QUIET_GAP of silence (None while still talking)."""
        last = None
        for t, lvl in zip(self.times, self.levels, strict=True):
            if t < since:
                continue
            if lvl > LOUD:
                last = t
            elif last is not None and t - last >= QUIET_GAP:
                return last
        return None


async def wait_for(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.perf_counter() + timeout
    while (value := condition()) is None or value is False:
        if time.perf_counter() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def voices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("speech")
    return {
        "ref": speak(REF_TEXT, d / "ref.wav"),
        "hello": speak("Hello there. Can you hear me?", d / "hello.wav"),
        "barge": speak("Sorry to interrupt, but I have a question.", d / "barge.wav"),
    }


@dataclass
class Bot:
    url: str
    log: Path


@pytest.fixture(scope="module")
def bot(voices: dict[str, Path]) -> Iterator[Bot]:
    """The example bot under Pipecat's development runner, as `python bot.py -t webrtc` starts it."""
    port = free_port()
    log_path = voices["ref"].parent / "bot.log"
    # The bot pins loopback as loopback_only does, then runs as `python examples/pipecat_webrtc_bot.py ...`.
    launcher = (
        "import aioice.ice, runpy, sys; "
        "aioice.ice.get_host_addresses = lambda use_ipv4=True, use_ipv6=True: ['127.0.0.1']; "
        f"sys.argv[0] = {str(BOT)!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    script = voices["ref"].parent / "script.txt"
    script.write_text("\n".join(SCRIPT) + "\n")
    args = ["--model", "synthetic:tiny", "--device", "cpu", "--max-frames", str(MAX_FRAMES)]
    args += ["--script", str(script)]
    args += ["--ref-audio", str(voices["ref"]), "--ref-text", REF_TEXT]
    args += ["-t", "webrtc", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LLM_MODEL", None)  # offline: the scripted responder answers
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, *args], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, f"bot exited: {log_path.read_text()[-3000:]}"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.time() < deadline, "bot did not start serving"
            time.sleep(0.2)
        yield Bot(f"http://127.0.0.1:{port}", log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def test_barge_in_over_webrtc(
    bot: Bot,
    voices: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    record_property: Callable[[str, object], None],
) -> None:
    monkeypatch.setattr(aioice.ice, "get_host_addresses", loopback_only)
    mic, speaker = Microphone(), Speaker()
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTrack(mic)
    pc.createDataChannel("chat")  # as the prebuilt browser client does: the bot's RTVI messages go here
    listeners: list[asyncio.Task] = []
    pc.on("track", lambda track: listeners.append(asyncio.create_task(speaker.listen(track))))
    try:
        await pc.setLocalDescription(await pc.createOffer())
        async with aiohttp.ClientSession() as http:
            offer = {"sdp": pc.localDescription.sdp, "type": pc.localDescription.type}
            async with http.post(f"{bot.url}/api/offer", json=offer) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        # The bot's output track sends silence as soon as its pipeline runs.
        await wait_for(lambda: len(speaker.times) > 25, 30, "the bot's audio track")

        mic.say(speech_48k(voices["hello"]))
        await wait_for(lambda: len(mic.ends) == 1, 10, "the first question to be spoken")
        first_reply = await wait_for(lambda: speaker.talking_since(mic.ends[0]), 20, "the bot to answer")
        await asyncio.sleep(CUT_IN_AFTER_S)
        assert speaker.stopped_after(first_reply) is None, (
            "the first answer is still playing when the caller cuts in"
        )

        mic.say(speech_48k(voices["barge"]))
        onset = await wait_for(lambda: mic.onsets[1] if len(mic.onsets) > 1 else None, 5, "the barge-in")
        stopped = await wait_for(lambda: speaker.stopped_after(onset), 10, "the bot to stop talking")
        latency = stopped - onset
        record_property("barge_in_stop_latency_s", round(latency, 3))
        print(f"\nbarge-in stop latency (caller speech onset -> bot audio stops): {latency * 1000:.0f} ms")
        assert latency < STOP_BOUND_S

        await wait_for(lambda: len(mic.ends) == 2, 10, "the barge-in to be spoken")
        second_reply = await wait_for(
            lambda: speaker.talking_since(stopped + QUIET_GAP), 20, "the next answer"
        )
        # No stale audio from the interrupted answer: silence until the caller has finished speaking.
        assert second_reply > mic.ends[1]
        await asyncio.sleep(1.5)
        assert speaker.stopped_after(second_reply) is None, "the next answer plays on"
        print(f"reply latency (caller stops -> bot audio): {(second_reply - mic.ends[1]) * 1000:.0f} ms")
        # Inside the bot the interruption cancelled the engine request itself, long before max_frames.
        cancelled = re.search(
            r"utterance cancelled after (\d+) frames.*engine stopped ([\d.]+) ms", bot.log.read_text()
        )
        assert cancelled, "the bot's TTS logs the cancelled utterance"
        assert int(cancelled[1]) < MAX_FRAMES
        record_property("bot_engine_cancel_latency_ms", float(cancelled[2]))
        print(f"engine cancel latency inside the bot: {cancelled[2]} ms")
    finally:
        for task in listeners:
            task.cancel()
        await pc.close()
