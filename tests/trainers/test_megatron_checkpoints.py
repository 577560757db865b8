"""The megatron-core trainer started from a user's checkpoint of each dense architecture, on
the CPU: transformers reads the directory, the tensors are written into megatron-core's
layout (``megatron_from_hf``), and the extractor's name rules (``LLAMA_RULES``, here on a
Llama and a Qwen3 for the first time) must give back exactly the checkpoint's tensors under
the architecture table's names; megatron-core's own forward must compute transformers' logits.

Tolerance: float32 on both sides, the same math summed in another order (fused QKV,
megatron's baddbmm attention): ``FP32_LOGIT_ATOL`` as in ``test_megatron.py``.
"""

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from colo.models.arch import hf_shapes  # noqa: E402
from colo.trainers import build  # noqa: E402
from tests.archs import save_checkpoint, tiny_config  # noqa: E402
from tests.conftest import fixed_batch  # noqa: E402
from tests.trainers.test_megatron import FP32_LOGIT_ATOL, PausedBackup  # noqa: E402


@pytest.mark.parametrize("case", ["llama", "qwen3", "qwen2-tied"])
def test_megatron_starts_from_the_checkpoint_and_computes_transformers_logits(tmp_path, case):
    from transformers import AutoModelForCausalLM

    config = tiny_config(case)
    saved = save_checkpoint(tmp_path, config, seed=3)
    trainer, saver = build("megatron", checkpoint=str(tmp_path), engine_dtype="float32", device="cpu")
    try:
        assert saver is None
        want = {n: p.detach() for n, p in saved.named_parameters()}
        got = trainer.hf_state()
        # LLAMA_RULES name every tensor as the architecture table does, and read back the checkpoint's bits
        assert {n: tuple(t.shape) for n, t in got.items()} == hf_shapes(config)
        assert all(torch.equal(got[n], want[n]) for n in want)
        # megatron-core's options for the architecture: Qwen3's q/k layernorm, Qwen2's qkv bias only
        names = {n for n, _ in trainer.model.named_parameters()}
        layer = "decoder.layers.0.self_attention."
        assert (layer + "q_layernorm.weight" in names) == (case == "qwen3")
        assert (layer + "linear_qkv.bias" in names) == case.startswith("qwen2")
        tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
        for step in range(2):  # at the checkpoint's weights, then after a step
            hf = AutoModelForCausalLM.from_config(config).eval()
            hf.load_state_dict(trainer.hf_state(), strict=not config.tie_word_embeddings)
            with torch.no_grad():
                ref = hf(tokens).logits.float()
            logits = trainer.logits(tokens.tolist())
            assert float((logits - ref).abs().max()) <= FP32_LOGIT_ATOL, step
            assert float(ref.abs().max()) > 0.1
            if step == 0:
                trainer._reinforce(fixed_batch(config))
        # paused (the GPU's offload-first), the probe is answered by a transformers twin of the architecture
        trainer._memory_backend = PausedBackup()
        assert float((trainer.logits(tokens.tolist()) - logits).abs().max()) <= FP32_LOGIT_ATOL
        assert type(trainer._cpu_twin).__name__ == type(saved).__name__
    finally:
        trainer.close()
    assert not dist.is_initialized()


def test_a_moe_checkpoint_is_not_a_dense_megatron_model():
    from colo.trainers.models import moe_model_config

    with pytest.raises(ValueError, match="megatron trainer builds dense models; qwen3_moe is a MoE"):
        build("megatron", model_config=moe_model_config("qwen3-moe-tiny"), seed=0, engine_dtype="float32",
              device="cpu")
    assert not dist.is_initialized()
