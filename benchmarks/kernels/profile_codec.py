"""Where a graphed codec call's device time goes: its kernels, counted and timed, by kind.

A codec call costs ~1.7 ms on an H100 whatever its size, and ~0.045 ms more a frame-row (`bench_device_budget.py`).
This builds the 12 Hz speech decoder with the released shapes and random weights (no checkpoint: the kernels'
times do not depend on the values), captures the streaming decode as CUDA graphs for a few (streams, frames)
shapes as the engine does, and for each: the replay's time (CUDA events, median of 30), and from one profiled
replay (CUPTI through torch.profiler) every kernel's name and time, grouped by kind (convolutions, GEMMs, the
fused Triton kernels, elementwise, copies and gathers). The replay's time less the kernels' sum is the time
between kernels.

    python -m benchmarks.kernels.profile_codec --out codec-profile.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.bench_engine import log
from benchmarks.kernels.bench_codec_convs import median_ms
from qwen3tts_agent.engine.audio import GraphedCodecDecode, StreamingCodecDecoder
from qwen3tts_agent.models.compat import import_qwen_tts
from qwen3tts_agent.models.synthetic_configs import speech_tokenizer_config

# Kernel kinds, first match wins (names as CUPTI reports them: cuDNN, cuBLAS, ATen's and Triton's kernels).
KINDS = (
    ("cudnn transpose", re.compile(r"nchwToNhwc|nhwcToNchw", re.I)),  # cuDNN's layout changes around a convolution
    ("attention", re.compile(r"sdpa|flash|fmha|attention", re.I)),  # the transformer's (cuDNN's or PyTorch's)
    ("conv", re.compile(r"conv|implicit|cudnn|winograd|fft|dgrad|wgrad|xmma|sm\d+_xmma|cutlass.*conv", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cublas|cutlass|ampere|hopper|sm90|nvjet", re.I)),
    ("triton", re.compile(r"^(?!void )[\w]+$")),  # a Triton kernel is named by its Python function alone
    ("gather/copy", re.compile(r"index|gather|scatter|copy|cat|CatArray|memcpy|memset|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|reduce|norm|softmax|clamp", re.I)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def build_decoder(size: str) -> torch.nn.Module:
    """The official speech decoder with `size`'s shapes (the released ones for 0.6b / 1.7b), random weights."""
    import_qwen_tts()
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    model = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**speech_tokenizer_config(size)))
    return model.decoder.eval()


def kernel_table(prof: torch.profiler.profile) -> list[dict[str, Any]]:
    """Each device kernel of a profile, in launch order: name, kind, microseconds."""
    rows = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name and not event.name.startswith("Memcpy"):
            rows.append({"name": event.name, "kind": kind_of(event.name), "us": event.time_range.elapsed_us()})
    return rows


def profile_kernels(run: Callable[[], object]) -> list[dict[str, Any]]:
    """The device kernels of one `run()` (after a warm-up run), from CUPTI."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return kernel_table(prof)


def summarize(kernels: list[dict[str, Any]], replay_ms: float) -> dict[str, Any]:
    by_kind: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"count": 0, "us": 0.0})
    by_name: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"count": 0, "us": 0.0})
    for k in kernels:
        for table, key in ((by_kind, k["kind"]), (by_name, k["name"][:120])):
            table[key]["count"] += 1
            table[key]["us"] += k["us"]
    total_us = sum(k["us"] for k in kernels)
    return {
        "replay_ms": replay_ms,
        "kernels": len(kernels),
        "kernel_sum_ms": total_us / 1000,
        "between_kernels_ms": replay_ms - total_us / 1000,
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["us"])),
        "top_kernels": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["us"])[:25]),
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.6b", help="the codec's shapes (the same for both released sizes)")
    parser.add_argument("--shapes", default="1x1,1x8,16x1,16x8,128x1,128x8", help="streams x frames, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("codec-profile.json"))
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    streams = sorted({b for b, _ in shapes})
    frames = sorted({t for _, t in shapes})

    decoder = build_decoder(args.size).to("cuda", torch.bfloat16)
    codec = StreamingCodecDecoder(decoder, max_streams=streams[-1])
    log(f"codec transformer: {codec.transformer_path}")
    graphs = GraphedCodecDecode(codec, scratch_start=0, batch_buckets=streams, frame_sizes=frames)
    graphs.capture(progress=False)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cudnn": torch.backends.cudnn.version(), "size": args.size, "shapes": {}}
    with torch.cuda.stream(torch.cuda.Stream()):
        for b, t in shapes:
            graph, _ = graphs._graphs[(b, t)]
            replay_ms = median_ms(graph.replay)
            torch.cuda.synchronize()
            kernels, profiled = profile_kernels(graph.replay), "graph replay"
            if not kernels:  # a CUPTI that does not trace kernels inside graphs: the same decode, eagerly
                eager = functools.partial(codec.decode, graphs._slots[:b], graphs._codes[:b, :t])
                kernels, profiled = profile_kernels(eager), "eager decode"
            report["shapes"][f"{b}x{t}"] = summary = {**summarize(kernels, replay_ms), "profiled": profiled}
            args.out.write_text(json.dumps(report, indent=2) + "\n")  # what a cut-short run measured
            kinds = ", ".join(f"{kind} {v['count']:.0f} / {v['us'] / 1000:.2f} ms" for kind, v in summary["by_kind"].items())
            log(f"{b}x{t}: replay {replay_ms:.2f} ms, {summary['kernels']} kernels, sum {summary['kernel_sum_ms']:.2f} ms"
                f" ({kinds})")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
