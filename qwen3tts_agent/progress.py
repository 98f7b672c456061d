"""Progress of long steps: a tqdm bar on a terminal, a log line every few seconds anywhere else.

A bar redraws itself with carriage returns. In a log file, a container's log or a CI job that makes one
endless line of redraws, so where stderr is not a terminal the same progress becomes ordinary log records
(INFO): one when the step starts, one every `LOG_INTERVAL_S` seconds, and one when it ends.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from types import TracebackType
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")

LOG_INTERVAL_S = 10.0

_default_logger = logging.getLogger(__name__)


def on_terminal() -> bool:
    """Whether progress bars can be drawn: stderr, where tqdm draws, is a terminal."""
    stream = sys.stderr
    try:
        return stream is not None and stream.isatty()
    except ValueError:  # closed
        return False


class Progress:
    """Counts work done and shows it as a bar (terminal) or as log lines (otherwise); a no-op when disabled.

    Use as a context manager, calling `update(n)` as work completes; `close()` reports the end.
    """

    def __init__(
        self,
        desc: str,
        *,
        total: float | None = None,
        unit: str = "it",
        unit_scale: bool = False,
        bar_format: str | None = None,
        enabled: bool = True,
        logger: logging.Logger | None = None,
    ) -> None:
        self.desc = desc
        self.total = total
        self.unit = unit
        self.n: float = 0
        self._unit_scale = unit_scale
        self._logger = logger or _default_logger
        self._bar: tqdm[Any] | None = None
        self._logging = enabled and not on_terminal()
        self._closed = not enabled
        self._started = self._last_log = time.monotonic()
        if enabled and not self._logging:
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, bar_format=bar_format)
        elif self._logging:
            self._logger.info("%s: started%s", desc, f" ({self._amount(total)})" if total is not None else "")

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._logging and time.monotonic() - self._last_log >= LOG_INTERVAL_S:
            self._last_log = time.monotonic()
            done = self._amount(self.n)
            if self.total:
                done = f"{done} of {self._amount(self.total)} ({100 * self.n / self.total:.0f}%)"
            self._logger.info("%s: %s", self.desc, done)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        else:
            self._logger.info("%s: %s in %.1f s", self.desc, self._amount(self.n), time.monotonic() - self._started)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _amount(self, n: float) -> str:
        if self._unit_scale:
            return tqdm.format_sizeof(n, self.unit)
        number = f"{n:.0f}" if float(n).is_integer() else f"{n:.2f}"
        return f"{number} {self.unit}"


def track(
    items: Iterable[T],
    desc: str,
    *,
    total: int | None = None,
    unit: str = "it",
    enabled: bool = True,
    logger: logging.Logger | None = None,
) -> Iterator[T]:
    """Yield `items`, showing progress as `Progress` does (a bar on a terminal, log lines otherwise)."""
    if total is None and isinstance(items, Sized):
        total = len(items)
    with Progress(desc, total=total, unit=unit, enabled=enabled, logger=logger) as progress:
        for item in items:
            yield item
            progress.update()


@contextlib.contextmanager
def library_bars(enabled: bool = True) -> Iterator[None]:
    """Let Hugging Face's own bars (hub downloads, checkpoint shards) draw only on a terminal, and only if
    `enabled`; their previous setting is restored afterwards."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as transformers_logging

    if enabled and on_terminal():
        yield
        return
    hub_was_on = not hub_utils.are_progress_bars_disabled()
    transformers_was_on = transformers_logging.is_progress_bar_enabled()
    hub_utils.disable_progress_bars()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hub_was_on:
            hub_utils.enable_progress_bars()
        if transformers_was_on:
            transformers_logging.enable_progress_bar()
