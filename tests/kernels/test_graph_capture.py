"""`GraphCapture` on a GPU: a graph is captured with cuDNN's attention left out of
`scaled_dot_product_attention`'s choice (`engine/runner/cuda_graphs.py` says why), its replay gives the same
attention as an eager call, and the choice is the caller's again once the capture is done. A capture that
fails without its eager run gets one and a valid graph; every graph is uploaded to the device at capture; two
families captured at once on two threads (`capture_beside`) replay what eager calls compute. The frame graphs,
captured after one eager frame step per batch bucket while the codec's are captured beside them, replay what
eager frame steps compute."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.gpu
def test_a_graph_is_captured_without_cudnn_attention_and_the_choice_is_restored() -> None:
    from qwen3tts_agent.engine.runner import GraphCapture

    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 64, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
    mask = torch.ones(32, 32, dtype=torch.bool, device="cuda").tril()  # a mask, as the codec's window has
    cudnn_allowed: list[bool] = []

    def attend() -> torch.Tensor:
        cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    before = torch.backends.cuda.cudnn_sdp_enabled()
    graph, out = GraphCapture().capture(attend)
    assert cudnn_allowed == [False, False]  # the eager run before the capture, and the capture
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_capture_that_fails_without_its_eager_run_gets_one_and_a_valid_graph() -> None:
    from qwen3tts_agent.engine.runner import GraphCapture

    x = torch.arange(8, device="cuda", dtype=torch.float32)
    calls: list[int] = []

    def doubled() -> torch.Tensor:
        calls.append(len(calls))
        if len(calls) == 1:  # as a first launch that sets itself up inside a capture fails
            raise RuntimeError("set-up inside a capture")
        return x * 2

    capture = GraphCapture()
    graph, out = capture.capture(doubled, eager=False)
    assert capture.eager_runs == 1 and len(calls) == 3  # the failed capture, the eager run, the capture
    x.add_(1)
    graph.replay()
    capture.finish(1, "doubling", time.perf_counter())
    torch.testing.assert_close(out, x * 2)


@pytest.mark.gpu
def test_every_captured_graph_is_uploaded_to_the_device_and_replays_what_eager_calls_compute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`cuGraphUpload` at capture (the module docstring of engine/runner/cuda_graphs.py says why): each graph of a
    family is uploaded, the family's log line says so, and the uploaded graphs replay right."""
    from qwen3tts_agent.engine.runner import GraphCapture

    generator = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(64, 64, device="cuda", generator=generator) for _ in range(2))
    matmuls = [lambda n=n: torch.relu(a[:n] @ b) for n in (8, 16, 64)]
    capture = GraphCapture()
    captured = [capture.capture(fn) for fn in matmuls]
    with caplog.at_level(logging.INFO, logger="qwen3tts_agent.engine.runner.cuda_graphs"):
        capture.finish(len(matmuls), "matmul", time.perf_counter())
    assert capture.uploaded == len(matmuls)
    assert "captured 3 matmul graphs in" in caplog.text and "; 3 uploaded to the device" in caplog.text
    a.mul_(-1)
    for (graph, out), fn in zip(captured, matmuls, strict=True):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, fn())


@pytest.mark.gpu
def test_two_families_captured_beside_each_other_replay_what_eager_calls_compute() -> None:
    """A convolution family (cuDNN plans: the codec's kind) on the helper thread beside a matmul family."""
    from qwen3tts_agent.engine.runner import GraphCapture, capture_beside

    generator = torch.Generator(device="cuda").manual_seed(0)
    signal = torch.randn(4, 16, 256, device="cuda", generator=generator)
    kernel = torch.randn(16, 16, 7, device="cuda", generator=generator)
    a, b = (torch.randn(64, 64, device="cuda", generator=generator) for _ in range(2))
    graphs: dict[str, list[tuple[Any, torch.Tensor]]] = {"conv": [], "matmul": []}
    threads: dict[str, str] = {}

    def family(name: str, fns: list[Any]) -> None:
        threads[name] = threading.current_thread().name
        capture = GraphCapture()
        graphs[name] = [capture.capture(fn) for fn in fns]  # the first with an eager run, the rest without
        capture.finish(len(fns), name, time.perf_counter())

    convs = [lambda n=n: F.conv1d(signal[:n], kernel, padding=3, dilation=1) for n in (1, 2, 4)]
    matmuls = [lambda n=n: a[:n] @ b for n in (8, 16, 32, 64)]
    capture_beside(torch.device("cuda"), lambda: family("matmul", matmuls), lambda: family("conv", convs))
    assert threads["matmul"] == threading.current_thread().name != threads["conv"]
    signal.mul_(-1)
    a.add_(1)
    for (graph, out), fn in [*zip(graphs["conv"], convs, strict=True), *zip(graphs["matmul"], matmuls, strict=True)]:
        graph.replay()
        torch.cuda.synchronize()
        # cuDNN may take another algorithm (TF32) on this thread than the helper's; the inputs changed sign
        torch.testing.assert_close(out, fn(), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_frame_graphs_captured_after_one_eager_run_per_batch_bucket_replay_the_eager_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`GraphedFrameStep.capture` runs a frame step eagerly only before each batch bucket's first kv bucket;
    the graphs captured without one still replay what eager steps compute (the same greedy codes)."""
    from qwen3tts_agent import Engine, SamplingParams, Voice
    from qwen3tts_agent.engine.runner import GraphCapture
    from qwen3tts_agent.engine.runner.kernel_paths import TRITON_PATH
    from qwen3tts_agent.models.loading import load_official_model

    official = load_official_model("synthetic:tiny-customvoice", device="cuda", progress=False)
    eager_runs: list[bool] = []  # the engine thread's captures (the codec's run beside them, on a helper thread)
    capture = GraphCapture.capture

    def recorded(self: GraphCapture, fn: Any, eager: bool | None = None) -> Any:
        if threading.current_thread().name == "qwen3tts-engine":
            eager_runs.append(eager)
        return capture(self, fn, eager)

    monkeypatch.setattr(GraphCapture, "capture", recorded)
    texts = ["Hello there, this is the first stream.", "And a second one beside it."]
    codes: dict[bool, list[list[list[int]]]] = {}
    for graphed in (True, False):
        engine = Engine(official, keep_codes=True, max_streams=4, max_seq_len=512, use_cuda_graphs=graphed,
                        backend="torch")
        try:
            assert engine.core.runner.kernel_paths["talker"] == engine.core.runner.kernel_paths["predictor"] == TRITON_PATH
            if graphed:
                engine.warmup(progress=False)
                # the frame graphs come first: batch buckets 1, 2, 4 x kv buckets 128, 256, 512
                assert eager_runs[:9] == [True, False, False] * 3
            streams = [engine.open_stream(text, voice=Voice(speaker=engine.speakers[0]),
                                          sampling=SamplingParams.greedy(max_frames=40, ignore_eos=True)) for text in texts]
            for stream in streams:
                list(stream.chunks(timeout=120))
            codes[graphed] = [stream.result.codes for stream in streams]
        finally:
            engine.close()
    assert all(len(c) == 40 for c in codes[True])
    assert codes[True] == codes[False]
