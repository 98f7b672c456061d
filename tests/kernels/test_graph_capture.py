"""`GraphCapture` on a GPU: a graph is captured with cuDNN's attention left out of
`scaled_dot_product_attention`'s choice (`engine/cuda_graphs.py` says why), its replay gives the same
attention as an eager call, and the choice is the caller's again once the capture is done."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.gpu
def test_a_graph_is_captured_without_cudnn_attention_and_the_choice_is_restored() -> None:
    from qwen3tts_agent.engine.cuda_graphs import GraphCapture

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
