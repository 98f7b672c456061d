"""Time the codec's dilated convolutions directly and split into phases (`codec.phase_split_conv`).

For every dilated convolution of the speech decoder, at the input shapes of a 32-stream × 8-frame streaming
decode: cuDNN's direct dilated convolution against the same convolution run undilated over the dilation's
phases (CUDA events, median of 30). Then the whole graphed decode with and without the split for the
dilations from `codec.PHASE_SPLIT_MIN_DILATION` up. Writes a JSON report.

    python -m benchmarks.kernels.bench_codec_convs --out codec-convs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from qwen3tts_agent.engine.audio import GraphedCodecDecode
from qwen3tts_agent.engine.audio import codec as codec_module
from qwen3tts_agent.models.loading import load_official_model

STREAMS, FRAMES = 32, 8


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median_ms(fn: Callable[[], object], reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:0.6b")
    parser.add_argument("--out", type=Path, default=Path("codec-convs.json"))
    args = parser.parse_args()
    official = load_official_model(args.model, device="cuda", dtype=torch.bfloat16, progress=True)
    decoder = official.model.speech_tokenizer.model.decoder
    codec = codec_module.StreamingCodecDecoder(decoder, max_streams=3 * STREAMS)
    chosen = set(codec._phase_split)
    codes = torch.randint(0, 2048, (STREAMS, FRAMES, 16), device="cuda")
    slots = list(range(STREAMS))

    # the input shape of every dilated convolution in such a decode, recorded with the split off, on the modules'
    # path (the default path's epilogues call the convolutions functionally, past the modules' hooks)
    recording = codec_module.StreamingCodecDecoder(decoder, max_streams=STREAMS, fused_audio=False)
    shapes: dict[torch.nn.Module, tuple[int, ...]] = {}

    def recorder(module: torch.nn.Module) -> Callable[..., None]:
        def record(conv: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            shapes.setdefault(module, tuple(inputs[0].shape))
        return record

    hooks = [
        module.conv.register_forward_pre_hook(recorder(module))
        for module in recording._convs if isinstance(module.conv, torch.nn.Conv1d) and module.conv.dilation[0] > 1
    ]
    recording._phase_split = set()
    recording.decode(slots, codes)
    del recording
    for hook in hooks:
        hook.remove()

    convs = []
    for module, shape in shapes.items():
        conv = module.conv
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        direct = median_ms(lambda conv=conv, x=x: conv(x))
        split = median_ms(lambda conv=conv, x=x: codec_module.phase_split_conv(conv, x))
        gap = float((conv(x).float() - codec_module.phase_split_conv(conv, x).float()).abs().max())
        row = {"channels": conv.in_channels, "dilation": conv.dilation[0], "input": list(shape),
               "direct_ms": direct, "phase_split_ms": split, "max_abs_diff_bf16": gap}
        convs.append(row)
        log(f"conv {row}")

    decodes = {}
    for name, split_set in (("direct", set()), ("phase_split", chosen)):
        codec._phase_split = split_set
        graphs = GraphedCodecDecode(codec, scratch_start=STREAMS if name == "direct" else 2 * STREAMS,
                                    batch_buckets=[STREAMS], frame_sizes=[FRAMES])
        graphs.capture(progress=False)
        decodes[name] = median_ms(lambda graphs=graphs: graphs.decode(slots, codes), reps=20)
        log(f"graphed decode {STREAMS} x {FRAMES}, {name}: {decodes[name]:.2f} ms")
    report = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "min_dilation": codec_module.PHASE_SPLIT_MIN_DILATION, "streams": STREAMS, "frames": FRAMES,
              "convs": convs, "graphed_decode_ms": decodes}
    args.out.write_text(json.dumps(report, indent=2))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
