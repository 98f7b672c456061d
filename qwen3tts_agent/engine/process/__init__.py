"""The engine core in a process of its own, and the clients that reach it over ZeroMQ.

`EngineProcess` (`supervisor.py`) starts a core process from a `CoreLaunch` and restarts it when it dies;
inside that process `core_server.py` runs an `Engine` and bridges its core to clients; `EngineClient` is the
engine's public API in any other process (server workers, Pipecat bots, benchmarks); `ipc.py` is the wire
format between them. Changes here are changes to how a core is deployed and reached. Nothing exported here
imports torch: the supervisor and the clients start at once and hold no model memory (`core_server.py`,
which does, is imported only inside the core process).
"""

from .client import EngineClient
from .launch import GIL_SWITCH_INTERVAL_S, CoreLaunch, fresh_core_address
from .supervisor import EngineProcess

__all__ = ["GIL_SWITCH_INTERVAL_S", "CoreLaunch", "EngineClient", "EngineProcess", "fresh_core_address"]
