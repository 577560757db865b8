import pytest
import torch
from transformers import Qwen2ForCausalLM

from colo.trainers.models import DEMO_DEFAULTS, build_trainer_model, demo_config

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)


def test_demo_config_is_a_small_untied_gqa_qwen2():
    c = demo_config()
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (1024, 256, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (4, 2, 512)
    assert c.max_position_embeddings == 256 and c.tie_word_embeddings is False
    assert c.rms_norm_eps == 1e-6 and c.rope_parameters["rope_theta"] == 10000.0
    assert c._attn_implementation == "sdpa" and c.hidden_act == "silu"


def test_demo_config_overrides_replace_fields_and_refuse_unknown_ones():
    c = demo_config(hidden_size=64, num_hidden_layers=2, rope_theta=500.0)
    assert (c.hidden_size, c.num_hidden_layers, c.rope_parameters["rope_theta"]) == (64, 2, 500.0)
    assert c.vocab_size == DEMO_DEFAULTS["vocab_size"]
    with pytest.raises(ValueError, match="'hiden_size'"):
        demo_config(hiden_size=64)


def test_trainer_model_is_float32_and_deterministic_per_seed():
    c = demo_config(**SMALL)
    before = torch.get_rng_state()
    a, b, other = build_trainer_model(c, 7), build_trainer_model(c, 7), build_trainer_model(c, 8)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is untouched
    assert isinstance(a, Qwen2ForCausalLM)
    sa, sb, so = a.state_dict(), b.state_dict(), other.state_dict()
    assert all(t.dtype == torch.float32 for t in sa.values())
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], so["model.embed_tokens.weight"])
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], so["model.layers.0.self_attn.q_proj.weight"])
    assert "lm_head.weight" in sa and sa["lm_head.weight"].data_ptr() != sa["model.embed_tokens.weight"].data_ptr()


def test_trainer_model_refuses_a_non_int_seed():
    with pytest.raises(ValueError, match="seed"):
        build_trainer_model(demo_config(**SMALL), "7")
