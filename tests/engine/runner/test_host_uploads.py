"""`upload_together`: several small arrays in one host-to-device copy, each back as its own tensor."""

from __future__ import annotations

import numpy as np
import torch

from qwen3tts_agent.engine.runner import upload_together
from qwen3tts_agent.engine.runner.host import HostData

CPU = torch.device("cpu")


def test_each_part_comes_back_with_its_values_dtype_and_shape_whatever_its_neighbours_sizes() -> None:
    """Parts of odd byte lengths in a row (3 bools, 5 float32s, 1 int64): each later one still starts at a 16-byte
    boundary."""
    parts: list[tuple[HostData, torch.dtype]] = [
        ([True, False, True], torch.bool),
        ([0.5, -1.25, 3.0, 1e-3, 7.5], torch.float32),
        ([2**40 + 3], torch.int64),
        (np.arange(2 * 3 * 4).reshape(2, 3, 4), torch.int64),
        (np.array([[1, 2], [3, 4]]), torch.int32),
        ([0.25, 0.5], torch.bfloat16),
    ]
    results = upload_together(parts, CPU)
    assert len(results) == len(parts)
    for (data, dtype), result in zip(parts, results, strict=True):
        expected = torch.as_tensor(data, dtype=dtype)
        assert result.dtype == dtype and result.shape == expected.shape
        assert torch.equal(result, expected)
        assert result.storage_offset() * result.element_size() % 16 == 0  # as aligned as a fresh tensor for kernels


def test_empty_parts_and_scalars_keep_their_shapes() -> None:
    empty, scalar, row = upload_together(
        [(torch.empty(0, 16, dtype=torch.int64), torch.int64), (torch.tensor(9), torch.int64), ([1.5], torch.float32)], CPU
    )
    assert empty.shape == (0, 16)
    assert scalar.shape == () and int(scalar) == 9
    assert row.tolist() == [1.5]


def test_parts_are_copies_not_views_of_the_callers_arrays() -> None:
    """The caller may reuse its arrays at once, on any device."""
    codes = np.arange(16).reshape(2, 8)
    slots = [3, 7]
    up_slots, up_codes = upload_together([(slots, torch.int64), (codes, torch.int64)], CPU)
    codes[:] = -1
    slots[0] = 99
    assert up_slots.tolist() == [3, 7]
    assert up_codes.tolist() == np.arange(16).reshape(2, 8).tolist()
