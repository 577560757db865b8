"""Real megatron-core GPT models on CPU processes joined by gloo, for the extractor tests.

Nothing here imitates Megatron: the models, their parallel layout, the
parameter attributes, the forward pass, the pipeline schedule and the
distributed checkpoint are megatron-core's own (0.16). What megatron-core needs
to run on a CPU-only torch (found by running it; each is the smallest change
that works):

- ``use_cpu_initialization=True`` (otherwise every parameter is allocated with
  ``device=torch.cuda.current_device()``) and ``perform_initialization=True``.
- ``torch.cuda.current_device`` answers the CPU: RotaryEmbedding.get_emb moves
  ``inv_freq`` to ``torch.cuda.current_device()`` on its first forward, and the
  pipeline send/recv allocates its receive buffers there.
- ``torch.cuda.synchronize`` does nothing: the batched pipeline send/recv and the
  distributed checkpoint saver call it; work on the CPU is done when the call returns.
- ``Tensor.cuda()`` returns the tensor: with tied embeddings and PP > 1,
  ``LanguageModule.setup_embeddings_and_output_layer`` moves the last stage's
  copy of the embedding with ``.cuda()`` before all-reducing it from the first stage.
- An RNG tracker whose ``fork()`` does nothing: DotProductAttention wraps its
  dropout in ``get_cuda_rng_tracker().fork()``, which reads and sets the CUDA
  RNG state. Dropout is 0 and the models are in eval mode, so no random number
  is drawn inside it. (``model_parallel_cuda_manual_seed``, which would set the
  tracker up, reads ``torch.cuda.get_rng_state()``: CUDA only.)
- An explicit causal ``attention_mask``: without one the unfused softmax builds
  its default mask with ``device="cuda"``.
- The local layer spec (Transformer Engine needs CUDA), ``attention_backend``
  local, and every fusion off (``bias_activation_fusion``,
  ``bias_dropout_fusion``, ``masked_softmax_fusion``, ``apply_rope_fusion``,
  ``gradient_accumulation_fusion``, ``persist_layer_norm``).
- MoE: the ``allgather`` token dispatcher (the ``alltoall`` one creates a
  ``torch.cuda.Stream`` in its constructor and uses it for its device-to-host
  copies; ``flex`` needs DeepEP), no grouped GEMM (SequentialMLP experts), no aux loss.
- ``moe_utils.te_general_gemm = None``: without Transformer Engine, megatron-core
  0.16.1's router gating (``RouterGatingLinearFunction.forward``) tests
  ``te_general_gemm is not None`` on a name its import fallback never defines,
  and raises NameError (on GPUs too).
- gloo is the default backend, so every group ``initialize_model_parallel``
  creates is a gloo group.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests import dist_helpers

VOCAB = 37          # the tokenizer's vocabulary (what HF sees)
PADDED_VOCAB = 40   # what Megatron builds: padded to a multiple of the TP size (Megatron-LM pads to 128 * TP)
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN = 16, 4, 2, 4, 24
EXPERTS, TOPK, MOE_FFN, SHARED_FFN = 4, 2, 8, 12
ROPE_THETA, EPS = 10000.0, 1e-6
BATCH, SEQ = 2, 12


@dataclass(frozen=True)
class Case:
    """One megatron-core model and parallel layout."""

    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    layers: int = 4
    moe: bool = False
    tied: bool = False
    norm: str = "RMSNorm"


def cpu_workarounds() -> None:
    """The CPU stand-ins listed in the module docstring; call once per worker, before building."""
    warnings.filterwarnings("ignore")  # "Transformer Engine and Apex are not installed" and the like
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None  # CPU work is done when the call returns
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from megatron.core.tensor_parallel import random as mrandom

    class _NoForkTracker(mrandom.CudaRNGStatesTracker):
        @contextlib.contextmanager
        def fork(self, name=None):
            yield

    mrandom._CUDA_RNG_STATE_TRACKER = _NoForkTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # the fallback its "except ImportError" forgets to define


def init_parallel(case: Case) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
                                 expert_model_parallel_size=case.ep)


def config(case: Case):
    """Qwen2's layout: RMSNorm, SwiGLU, grouped-query attention, QKV bias, no other bias, rotary
    (``case.norm`` can swap the norm, to build something the HF names cannot hold)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    moe = {}
    if case.moe:
        moe = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
                   moe_shared_expert_intermediate_size=SHARED_FFN, moe_shared_expert_gate=True,
                   # Qwen2-MoE: softmax over all experts, then top-k, not renormalized (norm_topk_prob=False)
                   moe_router_pre_softmax=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                   moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
    return TransformerConfig(
        num_layers=case.layers, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, normalization=case.norm, layernorm_epsilon=EPS,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=True,
        tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
        expert_model_parallel_size=case.ep, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        use_cpu_initialization=True, perform_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        attention_backend=AttnBackend.local, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, **moe)


def build(case: Case):
    """This rank's part of the model (its pipeline stage), randomized by ``randomize``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if case.moe else None, normalization=case.norm)
    torch.manual_seed(0)
    model = GPTModel(config=config(case), transformer_layer_spec=spec, vocab_size=PADDED_VOCAB,
                     max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), parallel_output=False,
                     share_embeddings_and_output_weights=case.tied, position_embedding_type="rope",
                     rotary_base=int(ROPE_THETA))
    randomize(model)
    if case.tied and case.pp > 1:
        # megatron-core's own tying across stages, again: zero the last stage's copy of the
        # embedding and all-reduce it from the first stage's
        model.setup_embeddings_and_output_layer()
    return model.eval()


def offsets(model) -> tuple[int, int]:
    """(first global layer of this stage, first global expert of this rank), from megatron-core itself."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = model.config
    layer = get_transformer_layer_offset(cfg)
    expert = 0
    if cfg.num_moe_experts:
        per_rank = cfg.num_moe_experts // ps.get_expert_model_parallel_world_size()
        expert = ps.get_expert_model_parallel_rank() * per_rank
    return layer, expert


def global_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    from colo.extractors import global_name

    layer, expert = offsets(model)
    return [(global_name(n, layer_offset=layer, expert_offset=expert), p) for n, p in model.named_parameters()]


def _seeded(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "little"))


def randomize(model) -> None:
    """Every parameter drawn afresh, so norms and biases (which Megatron starts at 1 and 0) carry
    information too. A parameter replicated over ranks (norms, router, shared-expert gate) gets the
    same values on every rank (seeded by its global name); a tensor-parallel shard, which only its rank
    holds, is seeded by its name and tensor-parallel rank."""
    from megatron.core import parallel_state as ps

    tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    with torch.no_grad():
        for name, p in global_params(model):
            shard = etp_rank if ".experts." in name else tp_rank
            key = f"{name}@tp{shard}" if getattr(p, "tensor_model_parallel", False) else name
            g = _seeded(key)
            if name.endswith("norm.weight") or name.endswith("layer_norm_weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _mask() -> torch.Tensor:
    # Megatron's convention: True = masked out
    return torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)


def megatron_logits(model, case: Case) -> torch.Tensor | None:
    """megatron-core's own forward. With PP > 1 the stages run in turn, handing the activations on
    with megatron-core's P2PCommunicator (recv_forward / send_forward, what its schedules call): its
    schedules themselves cannot run on CPU (forward_backward_pipelining_without_interleaving
    allocates ``torch.zeros(..., device="cuda")``). Logits over the real vocabulary on the last
    stage; ``None`` elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    tok = tokens()
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        if case.pp == 1:
            return model(tok, pos, attention_mask=_mask())[..., :VOCAB].clone()
        p2p = P2PCommunicator(ps.get_pipeline_model_parallel_group(), model.config)
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model.set_input_tensor(p2p.recv_forward((SEQ, BATCH, HIDDEN), first))
        out = model(tok if first else None, pos, attention_mask=_mask())
        p2p.send_forward(out, last)
        return out[..., :VOCAB].clone() if last else None


def hf_config(case: Case):
    if case.moe:
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=case.layers,
                              num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
                              intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                              shared_expert_intermediate_size=SHARED_FFN, num_experts=EXPERTS,
                              num_experts_per_tok=TOPK, norm_topk_prob=False, decoder_sparse_step=1,
                              mlp_only_layers=[], rms_norm_eps=EPS, rope_theta=ROPE_THETA,
                              max_position_embeddings=64, tie_word_embeddings=case.tied, hidden_act="silu",
                              output_router_logits=False)
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=case.layers,
                       num_attention_heads=HEADS, num_key_value_heads=GROUPS, intermediate_size=FFN,
                       rms_norm_eps=EPS, rope_theta=ROPE_THETA, max_position_embeddings=64,
                       tie_word_embeddings=case.tied, hidden_act="silu")


def hf_logits(tensors: dict[str, torch.Tensor], case: Case, where: Path) -> dict[str, Any]:
    """Logits of transformers' Qwen2 / Qwen2-MoE loaded, the way an engine or a user would, from a
    safetensors checkpoint holding exactly ``tensors``; the missing and unexpected keys transformers
    reports (names the checkpoint lacks, or the model does not know); for MoE, which experts the HF
    router picked in each layer (so a test can tell that every expert's weights were used)."""
    from safetensors.torch import save_file
    from transformers import Qwen2ForCausalLM, Qwen2MoeForCausalLM

    where.mkdir(parents=True, exist_ok=True)
    hf_config(case).save_pretrained(where)
    save_file({n: t.contiguous() for n, t in tensors.items()}, where / "model.safetensors")
    cls = Qwen2MoeForCausalLM if case.moe else Qwen2ForCausalLM
    model, info = cls.from_pretrained(where, output_loading_info=True, dtype=torch.float32,
                                      attn_implementation="eager")
    picked: list[list[int]] = []

    def record(module, inputs, out):  # Qwen2MoeTopKRouter returns (logits, weights, expert indices)
        picked.append(sorted(set(out[2].flatten().tolist())))

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers if case.moe]
    with torch.no_grad():
        logits = model.eval()(tokens()).logits
    for h in hooks:
        h.remove()
    return {"hf": logits, "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
            "experts_picked": picked}


#: a guard against a hang, not a measurement
HANG_GUARD_S = 300


def run_workers(fn: Callable, tmp_path: Path, *args: Any, world_size: int = 2) -> list[Any]:
    """``tests.dist_helpers.run_workers`` with workers that may start processes of their own:
    megatron-core's distributed checkpoint saver starts a multiprocessing Manager and forks a
    writer per file bucket (``strategies/filesystem_async.py``), which daemonic processes may not."""
    ctx = dist_helpers._mp_context()
    procs = [ctx.Process(target=dist_helpers._entry, args=(fn, r, world_size, str(tmp_path), args), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(2.0)  # time for the others to write their own tracebacks
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
    errors = [f"--- rank {r} ---\n{(tmp_path / f'error{r}.txt').read_text()}"
              for r in range(world_size) if (tmp_path / f"error{r}.txt").exists()]
    codes = [p.exitcode for p in procs]
    if errors or any(c != 0 for c in codes):
        hung = " (hang guard hit)" if time.monotonic() > deadline else ""
        raise AssertionError(f"worker processes failed{hung}, exit codes {codes}:\n" + "\n".join(errors))
    return [torch.load(tmp_path / f"result{r}.pt", weights_only=True) for r in range(world_size)]
