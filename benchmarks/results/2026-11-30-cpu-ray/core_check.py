"""Raw check of the machine's cores: the same single-threaded work (torch matmuls and interpreter work) in one
process, then in two at once, twice over. Prints work items per second. `python core_check.py 8` (seconds each)."""

from __future__ import annotations

import multiprocessing
import sys
import time
from multiprocessing.queues import Queue


def work(seconds: float, results: Queue[float]) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    items = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a = torch.tanh(a @ a * 0.01)
        sum(i * i for i in range(20_000))
        items += 1
    results.put(items / seconds)


def main() -> None:
    context = multiprocessing.get_context("spawn")
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    for processes in (1, 2, 1, 2):
        results: Queue[float] = context.Queue()
        workers = [context.Process(target=work, args=(seconds, results)) for _ in range(processes)]
        for w in workers:
            w.start()
        rates = [results.get() for _ in workers]
        for w in workers:
            w.join()
        each = ", ".join(f"{r:.1f}" for r in rates)
        print(f"{processes} process(es): {sum(rates):.1f} items/s in all ({each})", flush=True)


if __name__ == "__main__":
    main()
