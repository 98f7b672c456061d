"""The frame graphs' batch sizes (`cuda_graphs.frame_batch_buckets`): which graph a step of b rows runs."""

from __future__ import annotations

import bisect

import pytest

from qwen3tts_agent.engine.runner.cuda_graphs import FINE_BUCKETS_FROM, frame_batch_buckets


@pytest.mark.parametrize("limit", [1, 5, 64, 65, 100, 256, 300, 512])
def test_a_large_step_runs_a_graph_less_than_half_again_its_rows(limit: int) -> None:
    """Every batch size up to the slots has a graph; below FINE_BUCKETS_FROM rows the smallest that holds it
    is a power of two (at most twice its rows, as before), above it less than 1.5 times its rows (a step of
    137 rows ran the 256-row graph, now the 192-row one)."""
    buckets = frame_batch_buckets(limit)
    assert buckets == sorted(set(buckets)) and buckets[-1] == limit
    for rows in range(1, limit + 1):
        graph = buckets[bisect.bisect_left(buckets, rows)]
        if rows > FINE_BUCKETS_FROM:
            assert graph < 1.5 * rows, (rows, graph)
        else:
            assert graph < 2 * rows or graph == 1, (rows, graph)
    assert (192 in buckets) == (limit > 192)
