"""The engine on a GPU: throughput and latency (`bench_engine`), where a frame, a loop turn and a first audio
spend their time (`frame_timeline`, `loop_timeline`, `first_audio_timeline`), the device time one utterance
costs a loaded engine (`bench_device_budget`), and parity with the official package on the GPU (`gpu_parity`)."""
