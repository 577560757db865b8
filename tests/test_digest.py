"""colo.digest: the verification contract every engine meets."""

from __future__ import annotations

import pytest
import torch

from colo.digest import ReceivedDigest, expected_weights_digest, weights_digest
from colo.transports.wire import Piece


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "a.bias": torch.randn(64, generator=g),
            "b.weight": torch.randn(16, 64, generator=g).to(torch.bfloat16)}


def test_one_flipped_bit_in_any_tensor_changes_the_digest():
    state = _state()
    want = weights_digest(state.items())
    for name, t in state.items():
        for index in (0, t.numel() // 2, t.numel() - 1):
            for bit in (0, 7):
                flipped = t.clone()
                raw = flipped.view(-1).view(torch.uint8)
                raw[index * t.element_size()] ^= 1 << bit
                assert weights_digest({**state, name: flipped}.items()) != want, (name, index, bit)


def test_order_names_shapes_and_dtypes_are_part_of_it():
    state = _state()
    want = weights_digest(state.items())
    assert weights_digest(reversed(list(state.items()))) != want
    assert weights_digest([("other", state["a.weight"]), *list(state.items())[1:]]) != want
    assert weights_digest([("a.weight", state["a.weight"].reshape(32, 64)), *list(state.items())[1:]]) != want
    # the same bytes read as another dtype
    assert weights_digest([("a.weight", state["a.weight"].view(torch.int32)), *list(state.items())[1:]]) != want


def test_pieces_hash_to_the_same_entry_and_missing_names_are_named():
    state = _state()
    order = list(state)
    got = ReceivedDigest()
    flat = state["a.weight"].reshape(-1)
    for start, end in ((0, 1000), (1000, 2047), (2047, flat.numel())):  # runs of elements, in order
        got.add("a.weight", Piece(data=flat[start:end], offset=start, shape=tuple(state["a.weight"].shape)))
    got.add("a.bias", state["a.bias"])
    with pytest.raises(ValueError, match="b.weight"):
        got.digest(order)
    got.add("b.weight", state["b.weight"])
    assert got.digest(order) == weights_digest(state.items())
    # the trainer's side converts each tensor to the engine's dtype on its own
    fp32 = {n: t.float() for n, t in state.items()}
    assert expected_weights_digest(fp32, order, torch.bfloat16) == weights_digest(
        (n, t.to(torch.bfloat16)) for n, t in fp32.items())
    with pytest.raises(KeyError, match="not.here"):
        expected_weights_digest(state, ["not.here"], torch.float32)
