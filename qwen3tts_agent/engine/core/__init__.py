"""The engine core: the step loop that owns the device and turns messages into audio.

`EngineCore` (`core.py`) applies the messages that arrive (`engine/messages.py`), runs a turn's prompt work on
a lane of its own (`prompt_lane.py`), launches and collects frame steps (`launcher.py`) and hands decoded audio
out, asking the scheduler what to do and telling the runner and the audio pipeline to do it. `CoreConfig` and
`CoreStats` (`config.py`) are what a core is built with and what it counts. Changes here are changes to the
order of work in a turn and to fault isolation; the decisions themselves are the scheduler's.
"""

from .config import CoreConfig, CoreStats
from .core import EngineCore

__all__ = ["CoreConfig", "CoreStats", "EngineCore"]
