"""The engine's logits travel as float32 bytes: exact, and a short answer is refused."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from colo.engine.forward import decode_f32


def test_float32_bytes_round_trip_exactly_nan_and_extremes_included():
    t = torch.tensor([[1.0, -0.0, float("nan")], [3.4028235e38, 1e-45, -2.5]], dtype=torch.float32)
    data = base64.b64encode(t.numpy().astype("<f4").tobytes()).decode()
    got = decode_f32(data, [2, 3])
    assert got.dtype == torch.float32 and got.shape == (2, 3)
    assert torch.equal(got.view(torch.int32), t.view(torch.int32))  # bit for bit, the NaN too


def test_an_answer_whose_bytes_do_not_fill_its_shape_is_refused_naming_both():
    data = base64.b64encode(np.zeros(5, dtype="<f4").tobytes()).decode()
    with pytest.raises(ValueError, match=r"engine answered 20 bytes of float32 logits for shape \[2, 3\] \(24 bytes\)"):
        decode_f32(data, [2, 3])
