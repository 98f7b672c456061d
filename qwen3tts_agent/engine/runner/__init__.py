"""The model on the device: the talker and code predictor over slot KV caches, their prompts, their frame steps.

`ModelRunner` (`runner.py`) runs batched prefills and frame steps (predictor, talker, sampling: `layers.py`,
`sampling.py`, the Triton kernels where `kernel_paths.py` chose them), `PromptBuilder` (`prompt.py`) lays out
prompts as the official generate does, `Prefills` (`prefill.py`, with the voice prefix store of
`prefixes.py` and the staging cache of `staging.py`) and `FrameSteps` (`steps.py`) put them on the device as
CUDA graphs (`cuda_graphs.py`). The device plumbing the audio pipeline shares lives here too: pinned uploads
(`host.py`), the lanes' stream priorities (`lanes.py`) and graph capture. Changes here are changes to the
model's maths or to how it runs on a device; what runs when is the core's and the scheduler's.
"""

from .cuda_graphs import (
    GraphCapture,
    GraphedFrameStep,
    capture_beside,
    frame_batch_buckets,
    power_of_two_buckets,
    split_frames,
)
from .host import upload, upload_together
from .lanes import LanePriorities
from .prefill import MAX_PREFILL_ROWS, Prefills, prefix_store_options
from .prompt import PrefillRow, PromptBuilder
from .runner import ModelRunner
from .sampling import (
    DEFAULT_TOP_K_CAP,
    PCG_INCREMENT,
    PCG_MULTIPLIER,
    PCG_WORD_MULTIPLIER,
    SamplerRows,
    apply_repetition_penalty,
    hash_to_uniform,
)
from .steps import FrameSteps

__all__ = [
    "DEFAULT_TOP_K_CAP",
    "MAX_PREFILL_ROWS",
    "PCG_INCREMENT",
    "PCG_MULTIPLIER",
    "PCG_WORD_MULTIPLIER",
    "FrameSteps",
    "GraphCapture",
    "GraphedFrameStep",
    "LanePriorities",
    "ModelRunner",
    "PrefillRow",
    "Prefills",
    "PromptBuilder",
    "SamplerRows",
    "apply_repetition_penalty",
    "capture_beside",
    "frame_batch_buckets",
    "hash_to_uniform",
    "power_of_two_buckets",
    "prefix_store_options",
    "split_frames",
    "upload",
    "upload_together",
]
