"""The device time one stream costs a loaded server: frame steps, codec decodes and its prompt, per stream.

Under load the GPU is shared by three kinds of graph replay: the batched frame steps, the codec's decodes of
every stream's chunks, and new streams' prompts. This times each captured graph of a warmed engine alone on
the device (CUDA events around each replay, the median of 30: `bench_codec_convs.median_ms`) and adds up what one
utterance of `--frames` frames costs at a given batch: its share of `frames` frame steps of `rows` rows, of
the codec calls that decode its chunks (the engine's chunk schedule) `codec_batch` streams at a time, and of
one prompt. 1000 ms divided by that is the rate of new utterances one device could serve if nothing
overlapped and nothing waited, an upper bound on `serve`'s capacity that shows which part to make cheaper.

    python -m benchmarks.engine.bench_device_budget --model synthetic:1.7b-customvoice --out budget.json
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.bench_engine import log
from benchmarks.kernels.bench_codec_convs import median_ms
from qwen3tts_agent import Engine
from qwen3tts_agent.engine.runner import split_frames
from qwen3tts_agent.engine.scheduler.requests import scheduled_chunk
from qwen3tts_agent.engine.types import DEFAULT_CHUNK_SCHEDULE
from qwen3tts_agent.models.loading import load_official_model


def chunk_lengths(frames: int, schedule: tuple[int, ...]) -> list[int]:
    """The chunks an utterance of `frames` frames is cut into: the schedule, then its last size repeated."""
    chunks, left, i = [], frames, 0
    while left > 0:
        size = min(scheduled_chunk(schedule, i), left)
        chunks.append(size)
        left -= size
        i += 1
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:1.7b-customvoice")
    parser.add_argument("--max-streams", type=int, default=256)
    parser.add_argument("--kv-len", type=int, default=256, help="the frame steps' KV bucket")
    parser.add_argument("--frames", type=int, default=100, help="one utterance's frames (8 s)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    official = load_official_model(args.model, device="cuda", dtype=torch.bfloat16)
    engine = Engine(official, max_streams=args.max_streams)
    engine.warmup(progress=False)
    core = engine.core
    frame_graphs, codec_graphs = core.steps.graphs, core.audio._graphs
    assert frame_graphs is not None and codec_graphs is not None, "needs a GPU engine with CUDA graphs"
    report: dict[str, Any] = {"model": args.model, "max_streams": args.max_streams, "kv_len": args.kv_len,
                              "frames": args.frames, "device": torch.cuda.get_device_name()}

    def on_core() -> None:
        runner = core.runner
        saved = runner.active.clone()
        runner.active.zero_()  # a frame's work with no slot's state moving
        with torch.inference_mode(), torch.cuda.stream(torch.cuda.Stream()):
            report["frame_ms"] = {
                b: median_ms(functools.partial(frame_graphs, b, args.kv_len)) for b in frame_graphs.batch_buckets
            }
            # the codec graphs decode scratch slots: no live stream's state moves
            report["codec_ms"] = {
                f"{b}x{t}": median_ms(graph.replay)
                for (b, t), (graph, _) in sorted(codec_graphs._graphs.items())
            }
            prefill = core.prefills.graphs
            if prefill is not None:
                prefill.park()  # the warm-up's prompt left its bucket's indices: a shorter bucket would read past them
                report["prompt_ms"] = {
                    "x".join(map(str, key)): median_ms(graph.replay)
                    for key, (graph, _) in sorted(prefill._graphs.items()) if key[0] == 1
                }
            staged = core.prefills.staged_graphs
            if staged is not None and staged.captured:
                report["staged_prompt_ms"] = {
                    "x".join(map(str, key)): median_ms(graph.replay) for key, (graph, _) in sorted(staged._graphs.items())
                    if key[0] == 1
                }
        runner.active.copy_(saved)

    core.call(on_core).result()
    engine.close()

    # what one utterance costs, by the batch it shares its frame steps and codec calls with
    chunks = chunk_lengths(args.frames, DEFAULT_CHUNK_SCHEDULE)
    codec_batches = sorted({b for b, _ in codec_graphs._graphs})
    prompt = min(report.get("staged_prompt_ms", {}).values(), default=None) or min(report["prompt_ms"].values())
    budget = []
    for rows, frame_ms in report["frame_ms"].items():
        for b in codec_batches:
            codec = sum(report["codec_ms"][f"{b}x{t}"] for c in chunks for t in split_frames(c, codec_graphs.frame_sizes)) / b
            steps = args.frames * frame_ms / rows
            total = steps + codec + prompt
            budget.append({"rows": rows, "codec_batch": b, "steps_ms": steps, "codec_ms": codec, "prompt_ms": prompt,
                           "total_ms": total, "utterances_per_s": 1000 / total})
    report["chunks"], report["budget"] = chunks, budget
    for name in ("frame_ms", "codec_ms", "prompt_ms", "staged_prompt_ms"):
        log(f"{name}: " + ", ".join(f"{k}: {v:.3f}" for k, v in report.get(name, {}).items()))
    for row in budget:
        if row["rows"] in (64, 128, 192, 256) and row["codec_batch"] in (4, 8, 16, 32):
            log(f"rows {row['rows']:3d}, codec batch {row['codec_batch']:2d}: steps {row['steps_ms']:.2f} + codec "
                f"{row['codec_ms']:.2f} + prompt {row['prompt_ms']:.2f} = {row['total_ms']:.2f} ms an utterance "
                f"-> {row['utterances_per_s']:.0f} / s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
