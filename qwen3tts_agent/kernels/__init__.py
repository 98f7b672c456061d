"""Triton kernels of the decode path, one module per kernel family (see docs/kernels.md).

- `gemv`: the decode GEMV with a layer's norm, SwiGLU, residual or bias fused in; tiles per GPU as data
  (`configs/gemv_tiles.json`).
- `decode_layer`: a decoder layer's decode step (four GEMVs and the attention kernel).
- `sampling`: the sampling of one row of logits (`fused_sample`, and `sample_row` for other kernels).
- `frame`: the per-row bookkeeping that ends a predictor step and a talker step, sampling included.
- `conv_epilogue`: what follows each of the codec's audio-rate convolutions (bias, residual, SnakeBeta).
- `codebooks`, `history`, `codec_layer`: the codec's codebook sums, convolution histories and transformer layers.
- `common`: what they share (import guard, launch options, Triton helpers).

Each family has a `supports(...)` check; the engine decides at load which of its stacks run as these
kernels and keeps the others on PyTorch layers. The modules import triton lazily guarded, so the package
imports without it (`common.available` then reports False).
"""
