"""The Triton kernels and the device operations around them, one family at a time: GEMV tiles (`sweep_gemv`),
decode layers and stacks (`bench_kernels`), attention (`bench_attention`), sampling (`bench_sampling`) and the
codec's dilated convolutions (`bench_codec_convs`)."""
