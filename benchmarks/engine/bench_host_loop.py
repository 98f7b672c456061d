"""The engine core's host bookkeeping per batched step, at the row counts of a loaded GPU, on this machine's CPU.

Under load the core's thread reads every step back (`Scheduler.on_frame`: each row's codes, its end, the chunks
now due) and looks at launching the next (`Scheduler.runnable`, several times a turn) before the device gets
it: on a GPU that host time is the "read" part of the gap before a batched step (`step_gap_ms_by_hold`). This
drives the engine's own `Scheduler` as the core does, with no model and no device: N streams in their slots,
one step of every runnable row after another (20 ms apart on a simulated clock, codes from one reused buffer as
the steps' pinned buffers are), each chunk delivered as soon as it is cut, and times each call.

    python -m benchmarks.engine.bench_host_loop --rows 64 128 256 --out host-loop.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from qwen3tts_agent.engine.scheduler import RequestState, Scheduler
from qwen3tts_agent.engine.scheduler.requests import PromptShape
from qwen3tts_agent.engine.types import DEFAULT_CHUNK_SCHEDULE, TextLayout

STEP_S = 0.02  # the simulated clock's step period: a loaded batched step's order (docs/performance.md)
TEXT_TOKENS = 60  # each stream's text: its runaway guard allows 505 frames, beyond any run here
EOS_TEXT = 0
CODEBOOKS = 16


def loaded_scheduler(rows: int) -> Scheduler:
    """A scheduler with `rows` streams past their prompts, as the core's own (its defaults: deadline-aware chunks
    over the codec's decode sizes), each on a closed text."""
    scheduler = Scheduler(
        max_slots=rows, max_seq_len=2048, max_text_tokens=2048, max_prefill_rows=rows, eos_token_id=EOS_TEXT,
        decode_sizes=(1, 2, 4, 8),  # `AudioPipeline.decode_sizes` under the default chunk schedule
    )
    for i in range(rows):
        request = RequestState(f"s{i}", PromptShape(TextLayout.INTERLEAVED), DEFAULT_CHUNK_SCHEDULE, submitted=0.0)
        scheduler.add(request)
        scheduler.close_input(request, list(range(1, TEXT_TOKENS + 1)))
    scheduler.admit(0.0)
    for plan in scheduler.prefill_plans():
        scheduler.on_prefilled(plan, 10, 0.0)
        if plan.body_ids is not None:
            scheduler.on_fed(plan.request, [*plan.body_ids[1:], EOS_TEXT])
    for request, ids in scheduler.text_feeds():
        scheduler.on_fed(request, ids)
    return scheduler


def run(rows: int, steps: int, warmup: int) -> dict[str, Any]:
    """`steps` steps of `rows` streams (after `warmup` untimed ones, as the streams' chunks settle to the
    schedule's longest): each call's median and p95 in µs, and the chunks cut a step.

    The first steps leave some streams out, stream i stepping `i % longest` frames fewer, so that their chunks
    fall due on different steps, as streams that arrived at different times do: in step, every stream would cut
    its chunk on the same step and none on the others."""
    scheduler = loaded_scheduler(rows)
    buffer = np.zeros((rows, CODEBOOKS + 1), dtype=np.int64)  # one pinned host buffer, reused by every step
    times: dict[str, list[float]] = {"runnable": [], "on_launched": [], "on_frame": [], "deliver": []}
    chunks: list[int] = []
    longest = max(DEFAULT_CHUNK_SCHEDULE)
    warmup = max(warmup, longest)
    for i in range(warmup + steps):
        now = STEP_S * (i + 1)
        t0 = time.perf_counter()
        batch = scheduler.runnable()
        t1 = time.perf_counter()
        assert len(batch) == rows, f"{len(batch)} of {rows} streams runnable at step {i}"
        if i < longest:
            batch = [r for r in batch if int(r.request_id[1:]) % longest <= i]
        slots = [r.slot for r in batch]
        t2 = time.perf_counter()
        seq = scheduler.on_launched(batch)
        t3 = time.perf_counter()
        buffer[:, :CODEBOOKS] = i
        t4 = time.perf_counter()
        plans = scheduler.on_frame(batch, slots, buffer[:, :-1], buffer[:, -1], now)
        t5 = time.perf_counter()
        scheduler.on_step_done(seq)
        t6 = time.perf_counter()
        for plan in plans:
            scheduler.on_delivered(plan, now)
        t7 = time.perf_counter()
        if i < warmup:
            continue
        for name, seconds in (("runnable", t1 - t0), ("on_launched", t3 - t2), ("on_frame", t5 - t4), ("deliver", t7 - t6)):
            times[name].append(seconds)
        chunks.append(len(plans))
    return {
        "rows": rows,
        "steps": steps,
        "chunks_per_step": statistics.mean(chunks),
        "chunks_per_step_range": [min(chunks), max(chunks)],
        "us": {
            name: {"p50": 1e6 * statistics.median(s), "p95": 1e6 * float(np.percentile(s, 95))}
            for name, s in times.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = []
    for rows in args.rows:
        result = run(rows, args.steps, args.warmup)
        us = result["us"]
        print(f"{rows:4d} rows, {result['chunks_per_step']:.1f} chunks a step: "
              + ", ".join(f"{name} {v['p50']:.1f} / {v['p95']:.1f} µs" for name, v in us.items()), flush=True)
        results.append(result)
    if args.out is not None:
        report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                  "results": results}
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
