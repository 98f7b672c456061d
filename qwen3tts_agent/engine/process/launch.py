"""What an engine-core process is started with (`CoreLaunch`), shared by its supervisor and the process itself.

A module of its own so that the supervisor (`supervisor.py`, no torch) and the code inside the process
(`core_server.py`) both read it without importing each other.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The step loop and the I/O thread share the core process's interpreter lock: a short switch interval lets
# the I/O thread forward a request or an audio chunk within about a millisecond of it being ready.
GIL_SWITCH_INTERVAL_S = 0.0005
# What the supervisor sends the core to stop it (`EngineProcess.stop`): neither a terminal's Ctrl-C nor systemd's
# stop sends it, so the core can tell its supervisor's stop from theirs (`core_server._stop_on_signals`)
STOP_SIGNAL = signal.SIGUSR1


def remove_socket_file(address: str) -> None:
    """Remove the socket file of an `ipc://` address once the core bound to it is gone (other addresses have none).
    ZeroMQ leaves the file of an explicit `ipc://` bind behind when the socket closes (it removes only the files of
    wildcard binds), and a killed core closes nothing: without this, every run leaves a file in the temporary
    folder. A core bound to the address later replaces a file left there, so the files are litter, not a fault."""
    if address.startswith("ipc://"):
        Path(address.removeprefix("ipc://")).unlink(missing_ok=True)


# A socket file this old that refuses connections is left from a core killed outright; a younger one may be a core
# between its bind and its listen.
STALE_SOCKET_AGE_S = 60.0


def fresh_core_address(prefix: str) -> str:
    """An `ipc://` address of its own in the temporary folder for a core this process starts
    (`{prefix}-{pid}-{random}.sock`: processes of other pid namespaces sharing the folder do not collide), once
    the files other cores left under `prefix` have gone (`remove_stale_socket_files`)."""
    folder = Path(tempfile.gettempdir())
    remove_stale_socket_files(folder, prefix)
    return f"ipc://{folder}/{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


def remove_stale_socket_files(folder: Path, prefix: str) -> list[Path]:
    """Remove the `{prefix}-*.sock` files in `folder` that no core listens on any more (those of cores killed with
    their supervisor, which `remove_socket_file` never reached), and return them. A file counts as stale when it is
    over STALE_SOCKET_AGE_S old and refuses a connection: not by its pid, which another pid namespace may reuse."""
    removed = []
    for path in folder.glob(f"{prefix}-*.sock"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to inspect
            if time.time() - path.lstat().st_mtime < STALE_SOCKET_AGE_S or _listened_on(path):
                continue
            path.unlink()
            removed.append(path)
    return removed


def _listened_on(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # not a socket, no permission, a listener too busy to answer: leave it
            return True
        return True


@dataclass(frozen=True)
class CoreLaunch:
    """What an engine-core process loads and how it serves."""

    model: str
    address: str  # ZeroMQ address to bind, e.g. ipc:///tmp/qwen3tts-core.sock or tcp://127.0.0.1:5555
    device: str = "auto"
    dtype: str = "auto"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    warmup: bool = True
    log_level: str = "INFO"
    # core processes the supervisor started before this one after one died: added to the engine's `restarts`, so
    # an operator sees a killed and restarted core in the statistics the fresh one reports (`EngineProcess`)
    process_restarts: int = 0
