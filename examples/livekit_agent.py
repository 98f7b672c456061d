"""A LiveKit voice agent whose speech comes from one shared qwen3tts-agent server.

LiveKit runs every job in its own process, so the model is served once and each job streams to it:

    # the TTS server (one set of weights for all agent jobs)
    qwen3tts-agent serve --model Qwen/Qwen3-TTS-12Hz-0.6B-Base --host 0.0.0.0 --api-key "$QWEN3TTS_API_KEY" \
        --default-voice-audio my_voice.wav --default-voice-text "What the recording says."

    # the agent (LIVEKIT_URL, LIVEKIT_API_KEY and LIVEKIT_API_SECRET set as usual)
    pip install "qwen3tts-agent[livekit]"
    QWEN3TTS_URL=ws://tts-host:8000 QWEN3TTS_API_KEY=... python examples/livekit_agent.py dev

STT and LLM below are LiveKit Inference model strings; any LiveKit STT/LLM plugin works in their place.
The session prewarms the TTS when it starts (one server session opens in the background), and the plugin
reuses its server sessions from turn to turn (docs/livekit.md).
"""

from __future__ import annotations

import os

from livekit.agents import Agent, AgentServer, AgentSession, JobContext, cli

from qwen3tts_agent.livekit import TTS

server = AgentServer()


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    session = AgentSession(
        stt="deepgram/nova-3",
        llm="openai/gpt-4.1-mini",
        # URL and key come from QWEN3TTS_URL / QWEN3TTS_API_KEY; no voice means the server's default voice
        tts=TTS(voice=os.environ.get("QWEN3TTS_VOICE"), language="en"),
    )
    await session.start(
        agent=Agent(instructions="You are a friendly voice assistant. Keep answers short and conversational."),
        room=ctx.room,
    )
    await session.generate_reply(instructions="Greet the user and offer your help.")


if __name__ == "__main__":
    cli.run_app(server)
