"""Progress shows as a bar only on a terminal; anywhere else it is a few log lines and no carriage returns."""

from __future__ import annotations

import logging

import pytest
from huggingface_hub import utils as hub_utils
from transformers.utils import logging as transformers_logging

from qwen3tts_agent import progress
from qwen3tts_agent.progress import Progress, library_bars, track


def test_off_a_terminal_progress_is_log_lines(monkeypatch, caplog, capsys) -> None:
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)  # a line per update
    with caplog.at_level(logging.INFO, logger="qwen3tts_agent.progress"), \
            Progress("building", total=4 * 2**20, unit="B", unit_scale=True) as bar:
        bar.update(2**20)
        bar.update(3 * 2**20)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "building: started (4.19MB)"
    assert messages[1:3] == ["building: 1.05MB of 4.19MB (25%)", "building: 4.19MB of 4.19MB (100%)"]
    assert messages[3].startswith("building: 4.19MB in ") and len(messages) == 4
    captured = capsys.readouterr()
    assert "\r" not in captured.err + captured.out


def test_log_lines_are_spaced_by_the_interval(monkeypatch, caplog) -> None:
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    with caplog.at_level(logging.INFO, logger="qwen3tts_agent.progress"):
        items = list(track(range(1000), "capturing graphs"))
    assert items == list(range(1000))
    messages = [r.getMessage() for r in caplog.records]
    # a quick loop: its start and its end, none of the thousand updates in between
    assert messages[0] == "capturing graphs: started (1000 it)" and len(messages) == 2
    assert messages[1].startswith("capturing graphs: 1000 it in ")


def test_on_a_terminal_progress_is_a_tqdm_bar(monkeypatch, caplog, capsys) -> None:
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    with caplog.at_level(logging.INFO, logger="qwen3tts_agent.progress"), \
            Progress("speaking", unit="s audio", bar_format="{desc}: {n:.2f}{unit}") as bar:
        bar.update(0.5)
        bar.update(1.5)
    assert "speaking: 2.00s audio" in capsys.readouterr().err
    assert caplog.records == []


def test_disabled_progress_says_nothing(monkeypatch, caplog, capsys) -> None:
    for terminal in (True, False):
        monkeypatch.setattr(progress, "on_terminal", lambda terminal=terminal: terminal)
        with caplog.at_level(logging.INFO, logger="qwen3tts_agent.progress"):
            assert list(track("abc", "quiet", enabled=False)) == ["a", "b", "c"]
    assert caplog.records == [] and capsys.readouterr().err == ""


@pytest.mark.parametrize("terminal", [True, False])
def test_library_bars_only_on_a_terminal_and_restored(monkeypatch, terminal: bool) -> None:
    monkeypatch.setattr(progress, "on_terminal", lambda: terminal)
    assert not hub_utils.are_progress_bars_disabled() and transformers_logging.is_progress_bar_enabled()
    with library_bars(True):
        assert hub_utils.are_progress_bars_disabled() is not terminal
        assert transformers_logging.is_progress_bar_enabled() is terminal
    with library_bars(False):
        assert hub_utils.are_progress_bars_disabled() and not transformers_logging.is_progress_bar_enabled()
    assert not hub_utils.are_progress_bars_disabled() and transformers_logging.is_progress_bar_enabled()
