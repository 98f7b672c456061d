"""The engine beside other Qwen3-TTS implementations on the same checkpoints: the official package and
faster-qwen3-tts (`peers`)."""
