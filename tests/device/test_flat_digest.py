"""A one-copy trainer's digest read where its weights lie (FlatWeights.digest): the same digest
every engine must report (colo.digest's contract, computed tensor by tensor), for the spec
order asked; None where the buffer cannot answer (a tensor converted for the engine, one not in
it); refused where a parameter left the buffer (the buffer is not the weights then)."""

from __future__ import annotations

import pytest
import torch

from colo.device.flat_weights import FlatWeights
from colo.digest import expected_weights_digest
from colo.trainers import build
from colo.trainers.models import demo_config


def test_the_buffers_digest_is_the_contract_digest_in_the_order_asked():
    g = torch.Generator().manual_seed(2)
    tensors = {"a.weight": torch.randn(8, 3, generator=g), "a.bias": torch.randn(8, generator=g),
               "b.weight": torch.randn(5, 4, generator=g)}
    flat = FlatWeights.from_tensors(tensors, device="cpu")
    try:
        for order in (list(tensors), ["b.weight", "a.weight", "a.bias"]):
            assert flat.digest(order, torch.float32) == expected_weights_digest(tensors, order, torch.float32)
        # it reads the buffer now: a write to a view changes it
        before = flat.digest(list(tensors), torch.float32)
        flat.tensors["a.bias"][3] += 1
        assert flat.digest(list(tensors), torch.float32) != before
        assert flat.digest(list(tensors), torch.float32) == expected_weights_digest(flat.tensors, list(tensors),
                                                                                   torch.float32)
        # what it cannot answer: another dtype (the sender converts), a name not in the buffer
        assert flat.digest(list(tensors), torch.bfloat16) is None
        assert flat.digest([*tensors, "c.weight"], torch.float32) is None
        flat.tensors["a.weight"] = torch.zeros(8, 3)  # replaced: no longer the buffer's view
        with pytest.raises(ValueError, match="'a.weight' is no longer its view of the flat buffer"):
            flat.digest(list(tensors), torch.float32)
    finally:
        flat.close()


def test_a_one_copy_trainers_sent_digest_is_read_from_its_buffer_and_equals_the_tensor_by_tensor_one():
    trainer, _ = build("hf", model_config=demo_config(), seed=3, engine_dtype="float32", device="cpu")
    try:
        assert trainer.flat_weights is not None  # the one-copy trainer
        names = [s.name for s in trainer.param_specs()]
        want = expected_weights_digest(trainer.hf_state(), names, torch.float32)
        calls = []
        real = trainer.flat_weights.digest
        trainer.flat_weights.digest = lambda *a: calls.append(a) or real(*a)
        assert trainer.sent_digest(fresh=True) == want and len(calls) == 1
        assert real(names, torch.float32) == want  # the buffer answered (not the tensor-by-tensor fallback)
    finally:
        trainer.flat_weights.close()
