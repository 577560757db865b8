"""``python -m bench.copy_kernel``: the copying kernel's sweep (its GPU part runs on the device only)."""

import torch

from bench.copy_kernel import SHAPES, layout, main
from colo.core.buckets import TensorSpec


def test_the_sources_lie_on_256_byte_boundaries_one_after_the_other():
    specs = [TensorSpec("a", (3,), "bfloat16", 6), TensorSpec("b", (128,), "bfloat16", 256),
             TensorSpec("c", (1,), "float32", 4)]
    assert layout(specs) == ([0, 256, 512], 768)
    assert layout(specs, align=16) == ([0, 16, 272], 288)


def test_every_swept_shape_keeps_a_programs_span_within_two_blocks_of_the_multiplier():
    import colo.digest as D

    assert SHAPES[0] == (D._COPY_BLOCK, D._COPY_ITERS, D._COPY_WARPS)  # the default is swept first
    assert all(2 * b * i <= 1 << D.BLOCK_BITS for b, i, _ in SHAPES)


def test_it_refuses_a_machine_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        return
    assert main([str(tmp_path / "out.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "out.json").exists()
