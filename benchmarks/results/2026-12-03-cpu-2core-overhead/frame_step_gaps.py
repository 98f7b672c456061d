"""Time outside the graphs in a CPU-backend frame step: the frame step's wall time less its ONNX Runtime calls.

    ROOT=/path/to/tree python frame_step_gaps.py synthetic:0.6b 1 sampled   # or: ... 1 greedy
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.environ.get("ROOT", "."))

from qwen3tts_agent import Engine, SamplingParams  # noqa: E402
from qwen3tts_agent.backends.cpu import session  # noqa: E402
from qwen3tts_agent.models.loading import load_official_model  # noqa: E402


def main() -> None:
    spec, b, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    greedy = mode == "greedy"
    torch.set_num_threads(2)
    official = load_official_model(spec, device="cpu", dtype=torch.float32, progress=False)
    engine = Engine(official, max_streams=b, max_seq_len=512, backend="int8")
    runner = engine.core.runner
    sampling = SamplingParams.greedy(seed=1) if greedy else SamplingParams(seed=1)
    for slot in range(b):
        runner.reset_slot(slot, asdict(sampling))
    runner.active.zero_()
    in_graphs = [0.0]
    run = session.BoundSession.run

    def timed_run(self: session.BoundSession, binding: object) -> None:
        started = time.perf_counter()
        run(self, binding)
        in_graphs[0] += time.perf_counter() - started

    session.BoundSession.run = timed_run  # type: ignore[method-assign]
    with torch.inference_mode():
        for _ in range(3):
            runner.frame_step(b, 256, not greedy, not greedy)
        for _ in range(3):
            frames, graphs = [], []
            for _ in range(15):
                in_graphs[0] = 0.0
                started = time.perf_counter()
                runner.frame_step(b, 256, not greedy, not greedy)
                frames.append(1000 * (time.perf_counter() - started))
                graphs.append(1000 * in_graphs[0])
            outside = [f - g for f, g in zip(frames, graphs, strict=True)]
            print(f"b={b} frame p50 {statistics.median(frames):.1f} min {min(frames):.1f}  ort p50 "
                  f"{statistics.median(graphs):.1f}  non-ort p50 {statistics.median(outside):.2f} min {min(outside):.2f}  "
                  f"load {os.getloadavg()[0]:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
