"""The CPU backend beside PyTorch's CPU path on the host's cores (`bench_cpu`)."""
