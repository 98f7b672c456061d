"""The engine's decisions, on host data alone (no torch, no tensors): who takes a slot, what to prefill, which
rows step and when, which chunks to decode, when to refuse new streams.

`Scheduler` (`scheduler.py`) keeps each request's state (`requests.py`) and slots (`slots.py`); the step pacer
(`pacer.py`), the deadlines' arithmetic (`step_timing.py`), the device's load (`device_load.py`) and the codec
lane's batching (`codec_queue.py`) are its parts. The core reports what the device did and the scheduler
answers with plans, so its tests drive it with made-up step outputs. Changes here are changes of policy.
"""

from . import step_timing
from .codec_queue import CodecQueue
from .device_load import LateChunk
from .pacer import StepPacer
from .requests import ChunkPlan, PrefillPlan, PromptShape, RequestState
from .scheduler import Scheduler

__all__ = [
    "ChunkPlan",
    "CodecQueue",
    "LateChunk",
    "PrefillPlan",
    "PromptShape",
    "RequestState",
    "Scheduler",
    "StepPacer",
    "step_timing",
]
