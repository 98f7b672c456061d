"""`benchmarks/kernels/profile_codec.py` (a GPU tool): its kernel kinds and summary, checked here on the CPU."""

from __future__ import annotations

import pytest

from benchmarks.kernels.profile_codec import kind_of, summarize


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "conv"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false, true, 0>", "cudnn transpose"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x64_4x1x1_cga1x1x1_kernel0_0", "attention"),
    ("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "gemm"),
    ("_snake_kernel", "triton"),  # a Triton kernel: its Python function's name alone
    ("void at::native::index_copy_kernel_impl<at::native::OpaqueType<2> >", "gather/copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::OpaqueType<2>, unsigned int>", "gather/copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16> >", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >", "elementwise"),
])
def test_each_kernel_has_its_kind(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_the_summary_adds_kernels_by_kind_and_leaves_the_rest_between_them() -> None:
    kernels = [
        {"name": "_snake_kernel", "kind": "triton", "us": 30.0},
        {"name": "conv_a", "kind": "conv", "us": 100.0},
        {"name": "_snake_kernel", "kind": "triton", "us": 20.0},
    ]
    summary = summarize(kernels, replay_ms=0.2)
    assert summary["kernels"] == 3 and summary["kernel_sum_ms"] == pytest.approx(0.15)
    assert summary["between_kernels_ms"] == pytest.approx(0.05)
    assert list(summary["by_kind"]) == ["conv", "triton"]  # the most time first
    assert summary["by_kind"]["triton"] == {"count": 2, "us": 50.0}
    assert summary["top_kernels"]["_snake_kernel"] == {"count": 2, "us": 50.0}
