"""Engines sharing a GPU (Ray replicas of `num_gpus` 0.5): each engine's slots fit its share of the memory.

Two 128-slot 0.6B replicas on one 80 GB H100 ran out of memory (benchmarks/results/2026-12-05-h100-ray-1gpu):
Ray splits a GPU's compute between fractional replicas, not its memory, and each engine counted the whole
free memory as its own. The arithmetic is checked here; its use on a GPU needs one.
"""

from __future__ import annotations

import pytest
import torch

from qwen3tts_agent.engine.frontend.engine import (
    AUTO_MEMORY_FRACTION,
    Engine,
    graphs_out_of_memory,
    is_out_of_memory,
    memory_for_slots,
    slots_fit,
)
from qwen3tts_agent.errors import DeviceMemoryError
from qwen3tts_agent.ray.settings import RayServeSettings

GIB = 2**30


def test_a_whole_device_offers_what_is_free() -> None:
    memory, source = memory_for_slots(free=70 * GIB, total=80 * GIB, taken=2 * GIB, device_share=1.0)
    assert memory == 70 * GIB
    assert "70.0 GiB free" in source


def test_a_share_is_of_the_whole_device_less_what_this_engine_took() -> None:
    # both replicas start at once: each sees ~78 GiB free, but may take only half the device less its weights
    memory, source = memory_for_slots(free=78 * GIB, total=80 * GIB, taken=2 * GIB, device_share=0.5)
    assert memory == 38 * GIB
    assert "0.5 of 80.0 GiB" in source


def test_a_share_never_exceeds_what_is_free() -> None:
    memory, _ = memory_for_slots(free=10 * GIB, total=80 * GIB, taken=2 * GIB, device_share=0.5)
    assert memory == 10 * GIB
    memory, _ = memory_for_slots(free=10 * GIB, total=80 * GIB, taken=50 * GIB, device_share=0.5)
    assert memory == 0


def test_slots_asked_for_that_do_not_fit_are_refused_with_what_would() -> None:
    """`serve --max-streams 512` of 0.6B on an H100 (~250 MiB a slot at 2048 positions, 76 GiB free) once died of
    CUDA's out-of-memory error for 112 GiB mid-start; a whole device is checked now as a share always was."""
    per_slot = 250 * 2**20
    fits = int(76 * GIB * AUTO_MEMORY_FRACTION // per_slot)
    slots_fit(fits, per_slot, 76 * GIB, "76.0 GiB free")
    with pytest.raises(ValueError, match=rf"512 stream slots need 125.0 GiB .*76.0 GiB free.*use at most {fits} slots"):
        slots_fit(512, per_slot, 76 * GIB, "76.0 GiB free")


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_slots_asked_for_are_checked_on_a_whole_device_as_on_a_share(share: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check ran only for engines on a share of a GPU, so 512 slots on a whole H100 reached CUDA's allocator;
    now every number of slots asked for is checked (the check itself needs a GPU: here it is only watched)."""
    from qwen3tts_agent.engine.frontend import engine as engine_module

    checked: list[tuple[int, int, float]] = []
    monkeypatch.setattr(engine_module, "check_slots_fit",
                        lambda model, streams, positions, device_share: checked.append((streams, positions, device_share)))
    Engine.load("synthetic:tiny", device="cpu", progress=False, max_streams=3, max_seq_len=256, device_share=share).close()
    Engine.load("synthetic:tiny", device="cpu", progress=False, max_streams="auto", device_share=share).close()  # fits by construction
    assert checked == [(3, 256, share)]


def test_ray_replicas_below_one_gpu_build_engines_with_their_share() -> None:
    assert RayServeSettings(model="synthetic:tiny", num_gpus=0.5).engine_kwargs()["device_share"] == 0.5
    assert "device_share" not in RayServeSettings(model="synthetic:tiny", num_gpus=1.0).engine_kwargs()
    assert "device_share" not in RayServeSettings(model="synthetic:tiny", num_gpus=0.0).engine_kwargs()  # CPU


@pytest.mark.parametrize("positions", [0, -1])
def test_a_stream_slot_of_no_positions_is_refused(positions: int) -> None:
    with pytest.raises(ValueError, match="max_seq_len must be a positive number of positions"):
        Engine.load("synthetic:tiny", device="cpu", progress=False, max_seq_len=positions)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="device_share"):
        Engine.load("synthetic:tiny", device="cpu", progress=False, device_share=share)


@pytest.mark.parametrize(("error", "out_of_memory"), [
    (torch.AcceleratorError("CUDA error: out of memory"), True),  # what a graph capture raised on the H100
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),  # the caching allocator's
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), False),
    (RuntimeError("out of memory"), False),  # not the device's
])
def test_the_device_running_out_of_memory_is_told_from_other_faults(error: BaseException, out_of_memory: bool) -> None:
    assert is_out_of_memory(error) is out_of_memory


def test_graphs_that_do_not_fit_say_what_the_slots_took_and_what_would_help() -> None:
    """512 slots of 0.6B at 768 positions passed `slots_fit` on an H100 and died capturing their graphs with CUDA's
    bare "out of memory"; the engine now raises this instead (on a GPU: benchmarks/results)."""
    error = graphs_out_of_memory(512, 768, 115 * 2**20)
    assert isinstance(error, DeviceMemoryError)
    assert "512 stream slots of 768 positions" in str(error)
    assert "57.5 GiB, 115 MiB each" in str(error)
    assert "max_streams" in str(error) and "max_seq_len" in str(error) and "or max_streams 'auto'" in str(error)
    chosen = graphs_out_of_memory(240, 2048, 260 * 2**20, auto=True)  # no advice to choose what chose them
    assert "'auto' chose them" in str(chosen) and "or max_streams 'auto'" not in str(chosen)


def test_an_engine_whose_graphs_run_out_of_memory_raises_the_error_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the core's own thread, as `warmup` and a restarted core capture (a device's out-of-memory error is
    the one thing stood in for: a CPU has no graphs to capture); any other fault passes through unchanged."""
    engine = Engine.load("synthetic:tiny", device="cpu", progress=False, max_streams=3, max_seq_len=256)
    try:
        def capture(fault: BaseException) -> None:
            def fail(progress: bool) -> None:
                raise fault
            monkeypatch.setattr(engine.core, "capture_graphs", fail)

        capture(torch.AcceleratorError("CUDA error: out of memory"))
        with pytest.raises(DeviceMemoryError, match="3 stream slots of 256 positions") as raised:
            engine._capture_graphs(engine.core, progress=False)
        assert isinstance(raised.value.__cause__, torch.AcceleratorError)
        assert "or max_streams 'auto'" in str(raised.value)  # slots chosen by hand: "auto" is advice
        capture(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
        with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
            engine._capture_graphs(engine.core, progress=False)
    finally:
        engine.close()


def test_slots_that_auto_chose_and_whose_graphs_do_not_fit_are_said_to_be_autos(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine.load("synthetic:tiny", device="cpu", progress=False, max_streams="auto", max_seq_len=256)
    try:
        def fail(progress: bool) -> None:
            raise torch.AcceleratorError("CUDA error: out of memory")

        monkeypatch.setattr(engine.core, "capture_graphs", fail)
        with pytest.raises(DeviceMemoryError, match="'auto' chose them") as raised:
            engine._capture_graphs(engine.core, progress=False)
        assert "or max_streams 'auto'" not in str(raised.value)
    finally:
        engine.close()
