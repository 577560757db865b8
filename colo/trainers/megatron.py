"""A trainer backed by a real megatron-core ``GPTModel`` in the layout of a dense Qwen2, Qwen3 or
Llama: one rank of TP=N (PP=1).

The model is megatron-core's own: the local layer spec
(``get_gpt_layer_local_spec``), RMSNorm, SwiGLU (``gated_linear_unit`` with
silu), grouped-query attention, rotary positions, and an output layer of its own
unless the config ties it; what the architecture adds (:mod:`colo.models.arch`) is
megatron-core's option for it: Qwen2's bias on the fused ``linear_qkv``
(``add_qkv_bias``), Qwen3's per-head q/k RMSNorm (``qk_layernorm``) and its own head_dim
(``kv_channels``).
The REINFORCE loss is computed from ``GPTModel.forward``; the step is the
reference trainer's (:class:`colo.trainers.hf.ReferenceTrainer`): same
advantage, same AdamW, same learning rate and gradient clip.

What leaves the trainer (``hf_state()`` for the digest, ``extractor()`` for
the sync) goes through :class:`colo.extractors.megatron.MegatronExtractor`,
the same code a multi-rank Megatron trainer syncs through: fused QKV split per
query group, ``[gate; up]`` split, Hugging Face names.

The weights start as the reference trainer's do for the same seed (a Hugging
Face initialisation, written into the Megatron layout), or as a local Hugging Face
checkpoint holds them (``checkpoint=``: transformers reads the directory, and its
tensors are written into the Megatron layout by :func:`megatron_from_hf`, the inverse
of the extractor's ``LLAMA_RULES``; what the extractor reads back must be exactly
them): ``--trainer megatron`` and ``--trainer hf`` begin from the same policy, and a
test checks one step of each against the other.

torch.distributed and megatron's ``parallel_state`` are set up here when nobody
has (a one-rank group over a ``FileStore`` in a temporary directory: no port to
race for) and torn down by :meth:`MegatronTrainer.close` — which the owner must
call, or the process group outlives the trainer.

In a launcher's world of N ranks (torch.distributed initialised before
:func:`build`), the trainer is tensor parallel over all of them: megatron-core's
``initialize_model_parallel(tensor_model_parallel_size=N)`` shards the
GPTModel, each rank loads its slice of the same initial weights, the loss is
computed from the all-gathered full-vocabulary logits on every rank, and the
gradient clip uses the norm over the whole model (see
:meth:`MegatronTrainer._clip_grads`): every rank takes the one-rank step on its
shards. ``hf_state()``, ``logits()`` and the extractor all-gather over the
tensor-parallel group; every rank calls them and gets the full result.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import types
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from colo.trainers.base import PolicyTrainer, ReinforceConfig, _one_process, new_optimizer, param_dtype_for

#: What megatron marks a parameter with; a host view of a paused parameter is a
#: fresh tensor without them, and the extractor reads them.
_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")


# -- process groups ---------------------------------------------------------------


class MegatronRuntime:
    """torch.distributed and megatron's ``parallel_state`` for one rank of TP=N, PP=1,
    N the world's size (1, and a world of one rank started here, when there is none).

    Each is set up only if it is not already; :meth:`close` tears down only what
    this object set up, so a caller that initialised them keeps them.
    ``meta_group`` is a gloo group over the world: the extractor exchanges its
    metadata there (with a world on NCCL, a metadata exchange would otherwise
    create an NCCL communicator and its device buffers for nothing).
    ``tp_group`` is megatron's tensor-parallel group (``None`` with TP=1).
    """

    def __init__(self, device: str, *, seed: int):
        self.device = device
        self.tp = 1
        self.tp_group: Any = None
        self.owns_dist = False
        self.owns_parallel = False
        self.meta_group: Any = None
        self._tmp: str | None = None
        self._rng_set = False
        self._buffer_swapped = False
        self._prev_buffer: Any = None
        self._closed = False
        try:
            self._start(seed)
        except BaseException:
            self.close()
            raise

    def _start(self, seed: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import random as mrandom

        cuda = self.device == "cuda"
        if not dist.is_initialized():
            self._tmp = tempfile.mkdtemp(prefix="colo-megatron-")
            store = dist.FileStore(os.path.join(self._tmp, "store"), 1)
            dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
            self.owns_dist = True
        self.tp = dist.get_world_size()
        # refused before any collective: every rank refuses alike, where a group made first and
        # closed by the refusal's cleanup could be closed on a fast rank while a slow one still
        # connects to it (gloo's "Connection closed by peer" there, on a busy two-core machine)
        if ps.model_parallel_is_initialized():
            tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
            if (tp, pp) != (self.tp, 1):
                raise ValueError(f"megatron trainer: parallel_state is initialised with TP={tp}, PP={pp}; this "
                                 f"trainer needs TP={self.tp} (the world's size) and PP=1")
        self.meta_group = dist.new_group(list(range(self.tp)), backend="gloo")

        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=1)
            self.owns_parallel = True
        if self.tp > 1:
            self.tp_group = ps.get_tensor_model_parallel_group()

        self._rng_set = True
        if cuda:
            # Megatron's GPU init and its attention (for dropout, on every
            # forward) fork the CUDA RNG tracker's model-parallel state: seed it.
            mrandom.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        else:
            # CPU workaround: the tracker forks *CUDA* RNG states. Dropout is 0
            # here and the CPU init (use_cpu_initialization) draws from the CPU
            # generator, so the inference tracker, whose fork does nothing, is exact.
            mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            # CPU workaround: DotProductAttention takes its score buffer from the
            # global memory buffer, which allocates on the current CUDA device.
            # (It is baddbmm's input with beta=0: its contents are never read.)
            self._prev_buffer = ps._GLOBAL_MEMORY_BUFFER
            ps._GLOBAL_MEMORY_BUFFER = _host_memory_buffer()
            self._buffer_swapped = True

    def close(self) -> None:
        """Idempotent; safe after a failed start."""
        if self._closed:
            return
        self._closed = True
        from megatron.core import parallel_state as ps
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.tensor_parallel import random as mrandom

        # RotaryEmbedding.forward is an lru_cache on the method: it keeps every
        # model it has seen (and its device tensors) alive.
        cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
        if self._rng_set:
            mrandom.initialize_rng_tracker(force_reset=True)  # back to a fresh, unseeded tracker
        if self.owns_parallel:
            ps.destroy_model_parallel()  # drops the global memory buffer too
        elif self._buffer_swapped:
            ps._GLOBAL_MEMORY_BUFFER = self._prev_buffer
        if dist.is_initialized():
            if self.owns_dist:
                dist.destroy_process_group()  # the world and every group in it
            elif self.meta_group is not None:
                dist.destroy_process_group(self.meta_group)
        self.meta_group = self.tp_group = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _host_memory_buffer() -> Any:
    from megatron.core.utils import GlobalMemoryBuffer

    class HostMemoryBuffer(GlobalMemoryBuffer):
        """megatron's GlobalMemoryBuffer, on the CPU (CPU workaround, see MegatronRuntime)."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            n = math.prod(tensor_shape)
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < n:
                buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype, requires_grad=False)
            return buf[:n].view(*tensor_shape)

    return HostMemoryBuffer()


# -- the model --------------------------------------------------------------------


def gpt_dims(hf_config: Any) -> dict[str, Any]:
    """The numbers of a dense config megatron needs, and its architecture's options
    (:mod:`colo.models.arch`); refuses what the model here does not implement."""
    from colo.models.arch import arch_of

    arch = arch_of(hf_config)
    if arch.moe:
        raise ValueError(f"megatron trainer builds dense models; {arch.model_type} is a MoE (colo syncs "
                         f"megatron-core MoE models through MegatronExtractor, see tests/engine/test_moe.py)")
    unsupported = []
    if getattr(hf_config, "use_sliding_window", False):
        unsupported.append("use_sliding_window=True")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf_config.hidden_act!r} (only 'silu')")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        unsupported.append(f"rope_type={rope.get('rope_type')!r} (only 'default')")
    if unsupported:
        raise ValueError("megatron trainer does not support " + "; ".join(unsupported))
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % groups:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({groups})")
    return {"heads": heads, "groups": groups,
            "head_dim": getattr(hf_config, "head_dim", None) or arch.default_head_dim
            or hf_config.hidden_size // heads,
            "rope_theta": float(theta), "tied": bool(getattr(hf_config, "tie_word_embeddings", False)),
            "qkv_bias": arch.qkv_bias, "qk_norm": arch.qk_norm, "model_type": arch.model_type}


def check_tensor_parallel(hf_config: Any, tp: int) -> None:
    """Refuse a model megatron-core cannot split over ``tp`` ranks (it would assert deep
    inside the build). The vocabulary need not divide: it is padded (:func:`padded_vocab`)."""
    d = gpt_dims(hf_config)
    sizes = {"num_attention_heads": d["heads"], "num_key_value_heads (query groups)": d["groups"],
             "intermediate_size (FFN)": hf_config.intermediate_size}
    bad = [f"{name} {n}" for name, n in sizes.items() if n % tp]
    if bad:
        raise ValueError(f"megatron trainer: tensor parallel over {tp} ranks needs {', '.join(sizes)} divisible "
                         f"by {tp}; got " + ", ".join(bad))


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Megatron's vocabulary: each tensor-parallel rank holds an equal slice, so the
    rows are padded to a multiple of TP (the extractor and the logits cut the padding off)."""
    return -(-vocab_size // tp) * tp


def build_gpt(hf_config: Any, *, device: str, params_dtype: torch.dtype = torch.float32) -> Any:
    """A megatron-core ``GPTModel`` shaped like ``hf_config`` (parameters in ``params_dtype``,
    megatron's own random init), this rank's shard on ``device``. Needs ``parallel_state`` (see
    :class:`MegatronRuntime`); the vocabulary is padded to a multiple of its TP size."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    d = gpt_dims(hf_config)
    config = TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=d["heads"],
        num_query_groups=d["groups"], kv_channels=d["head_dim"],
        normalization="RMSNorm", layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True, activation_func=F.silu,
        # Qwen2: a bias on q, k, v only; Qwen3, Llama: none. Qwen3: q/k RMSNorm per head
        add_bias_linear=False, add_qkv_bias=d["qkv_bias"], qk_layernorm=d["qk_norm"],
        hidden_dropout=0.0, attention_dropout=0.0,  # as the reference trainer (Qwen2's dropout is 0)
        # bf16 parameters: megatron's bf16 training (its softmax then runs in fp32)
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        # the local layer spec's own attention; "auto" sets NVTE_*_ATTN in os.environ,
        # which every process started afterwards inherits (it broke megatron tests run later)
        attention_backend=AttnBackend.local,
        # CPU workaround: without it megatron allocates parameters (and rotary
        # frequencies) on the current CUDA device. On a GPU they are allocated
        # there directly, inside the caller's memory-saver region.
        use_cpu_initialization=device == "cpu",
        # The values are overwritten from the reference initialisation right
        # after (load_hf), but megatron's init must still run: it is what marks
        # each weight tensor_model_parallel / partition_dim / partition_stride
        # (linear_fc1: stride 2), which the extractor plans from.
        perform_initialization=True,
        # Unfused paths everywhere: the fused kernels (apex, TE, megatron's
        # CUDA extensions) are CUDA-only and not installed on a CPU box; the
        # unfused ones run on both devices, so CPU and GPU compute the same thing.
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    # megatron's CPU init draws from the global generator: leave the caller's
    # random state as it was (its GPU init draws from the RNG tracker's own states).
    with torch.random.fork_rng(devices=[]):
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=d["qk_norm"])
        model = GPTModel(config=config, transformer_layer_spec=spec,
                         vocab_size=padded_vocab(hf_config.vocab_size, ps.get_tensor_model_parallel_world_size()),
                         max_sequence_length=hf_config.max_position_embeddings,
                         pre_process=True, post_process=True, share_embeddings_and_output_weights=d["tied"],
                         position_embedding_type="rope", rotary_base=d["rope_theta"])
    if device == "cpu":
        rope = model.rotary_pos_emb
        if rope.rotary_interleaved:
            raise ValueError(f"megatron trainer: interleaved rotary embeddings are not {d['model_type']}'s")
        # CPU workaround: RotaryEmbedding.get_emb moves its frequencies to the
        # current CUDA device on first use. The same computation, left on the CPU:
        rope.get_emb = types.MethodType(_host_rotary_emb, rope)
    return model


def _host_rotary_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim/2]
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, dim], non-interleaved


def megatron_from_hf(hf: Mapping[str, torch.Tensor], hf_config: Any, *,
                     vocab_rows: int | None = None) -> dict[str, torch.Tensor]:
    """HF tensors of a dense Qwen2, Qwen3 or Llama in the full (unsharded) Megatron GPT layout:
    the inverse of the extractor's rules (``LLAMA_RULES``).

    Megatron's ``linear_qkv`` holds, per query group, that group's query heads
    then its key head then its value head (and its bias likewise, where the architecture
    has one); ``linear_fc1`` holds ``[gate; up]``; Qwen3's q/k norms are
    ``self_attention.q_layernorm`` / ``k_layernorm``.
    ``vocab_rows``: the embedding and output layer are padded with zero rows to
    it (:func:`padded_vocab`); a zero output row never gets a gradient, since the
    logits are cut to the vocabulary before the loss.
    """
    d = gpt_dims(hf_config)
    groups, hd = d["groups"], d["head_dim"]
    per = d["heads"] // groups

    def qkv(kind: str, i: int) -> torch.Tensor:
        q, k, v = (hf[f"model.layers.{i}.self_attn.{x}_proj.{kind}"] for x in "qkv")
        rest = q.shape[1:]
        parts = [q.reshape(groups, per * hd, *rest), k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def vocab(t: torch.Tensor) -> torch.Tensor:
        pad = (vocab_rows or t.shape[0]) - t.shape[0]
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    out = {"embedding.word_embeddings.weight": vocab(hf["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not d["tied"]:
        out["output_layer.weight"] = vocab(hf["lm_head.weight"])
    for i in range(hf_config.num_hidden_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv("weight", i)
        if d["qkv_bias"]:
            out[m + "self_attention.linear_qkv.bias"] = qkv("bias", i)
        if d["qk_norm"]:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


@torch.no_grad()
def load_hf(model: torch.nn.Module, hf: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Write HF tensors (:func:`megatron_from_hf`) into a megatron GPTModel's parameters, this rank's slice of
    each (in place: a memory region the parameters were allocated in keeps them)."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    src = megatron_from_hf(hf, hf_config, vocab_rows=padded_vocab(hf_config.vocab_size, size))
    params = dict(model.named_parameters())
    missing, extra = sorted(set(params) - set(src)), sorted(set(src) - set(params))
    if missing or extra:
        raise ValueError(f"megatron trainer: the GPTModel's parameters and the HF layout differ: "
                         f"not written {missing}, no such parameter {extra}")
    for name, p in params.items():
        mine = tp_slice(src[name], p, rank, size)
        if tuple(p.shape) != tuple(mine.shape):
            raise ValueError(f"megatron trainer: {name} is {tuple(p.shape)} on tensor-parallel rank {rank} of "
                             f"{size}, the HF layout gives {tuple(mine.shape)}")
        p.copy_(mine)


def tp_slice(full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s shard of ``full``, as megatron lays ``param`` out.

    A ``partition_stride`` s means ``full`` is s blocks along ``partition_dim``,
    each split over the ranks, and a rank holds its piece of every block in turn
    (megatron-core's ``_initialize_affine_weight_cpu``): a GLU ``linear_fc1``
    (stride 2) holds ``[gate_r; up_r]``.
    """
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    blocks = torch.tensor_split(full, stride, dim=dim)
    return torch.cat([torch.tensor_split(b, size, dim=dim)[rank] for b in blocks], dim=dim)


# -- the trainer ------------------------------------------------------------------


class MegatronTrainer(PolicyTrainer):
    """A :class:`~colo.core.interfaces.TrainerSide` over a megatron-core GPTModel, plus
    ``hf_state()``, ``logits()``, ``steps`` and ``num_params()`` (see :mod:`colo.trainers`).

    ``runtime`` (a :class:`MegatronRuntime`) is closed by :meth:`close`.
    """

    def __init__(self, model: torch.nn.Module, *, hf_config: Any, runtime: MegatronRuntime,
                 engine_dtype: str = "bfloat16", config: ReinforceConfig | None = None,
                 memory_backend: Any = None, flat: Any = None):
        from colo.extractors.megatron import MegatronExtractor

        self.model = model
        #: one rank on a GPU: the :class:`~colo.device.flat_weights.FlatWeights` the parameters
        #: were adopted into, which the memory backend pauses as the weights tag (one copy of
        #: one buffer, not the memory saver's allocation at a time).
        self._flat = flat
        #: and what the engine reads in a one-copy sync (:func:`colo.transports.packed.one_copy_bucket`):
        #: the extractor's ``source_views`` say where each HF tensor lies in it, the fused QKV's
        #: q, k and v strided (rows interleaved per query group), linear_fc1's gate and up as
        #: row ranges. Its slots are Megatron's names, so the digest is the extractor's
        #: (``flat.digest`` finds no HF name there and ``sent_digest`` reads ``hf_state()``).
        self.flat_weights = flat
        self.hf_config = hf_config
        self.runtime = runtime
        self.config = config or ReinforceConfig()
        self.engine_dtype = engine_dtype
        self.opt = new_optimizer(self.model.parameters(), self.config)
        self._memory_backend = memory_backend
        d = gpt_dims(hf_config)
        self._extractor_args = {"attention": (d["heads"], d["groups"]), "vocab_size": hf_config.vocab_size,
                                "group": runtime.meta_group, "tp_group": runtime.tp_group}
        # Pairs, not a mapping: a Parameter is followed through optimizer steps.
        live = list(self.model.named_parameters())
        #: the sync's extractor of whole tensors, and the one it uses (:meth:`send_own_slices`)
        self._whole_extractor = MegatronExtractor(live, dtype=getattr(torch, engine_dtype), **self._extractor_args)
        self._extractor = self._whole_extractor
        #: what the sync's extractors are built with beside ``_extractor_args`` (``tp_slices``)
        self._slice_args: dict[str, Any] = {}
        self._hf_extractor = MegatronExtractor(live, dtype=None, **self._extractor_args)
        self._cpu_twin: torch.nn.Module | None = None
        self.steps = 0

    def send_own_slices(self, tp_slices: Mapping[str, int] | None) -> None:
        """From now on, sync each tensor-parallel tensor the engine's ranks split where this
        trainer's TP ranks do as this rank's own slice, with no gather
        (:class:`~colo.extractors.megatron.MegatronExtractor`'s ``tp_slices``: HF name ->
        the engine's split dimension, ``colo.engine.reference.tp.split_dims``); ``None``:
        whole tensors again. For an engine whose TP ranks are this trainer's TP group in
        its order and that takes a rank's slice (colo's TP engine), through a transport
        that marks them (``packed``). A collective: every rank calls it, with the same mapping."""
        from colo.extractors.megatron import MegatronExtractor

        if self.runtime.tp_group is None:
            raise ValueError("megatron trainer: send_own_slices needs tensor parallelism over 2 or more ranks; "
                             "this trainer has one")
        self._slice_args = {"tp_slices": dict(tp_slices)} if tp_slices else {}
        self._extractor = self._whole_extractor if not tp_slices else MegatronExtractor(
            list(self.model.named_parameters()), dtype=getattr(torch, self.engine_dtype),
            **self._extractor_args, **self._slice_args)

    # -- TrainerSide -----------------------------------------------------------
    def param_specs(self) -> Any:
        """Every HF tensor whole (what an engine preflights), whatever the sync sends."""
        return self._whole_extractor.specs()

    def extractor(self, whole: bool = False) -> Any:
        """The sync's extractor: of this rank's own slices where :meth:`send_own_slices` said so,
        unless ``whole`` (every tensor whole: a transport that cannot mark a slice)."""
        slices = {} if whole else self._slice_args
        if self._paused():
            # offload-first on a GPU: the weights are paused, their pinned host
            # backup is the source; shards are uploaded, then converted and split
            # on the device (a host-side conversion would be pageable memory).
            from colo.extractors.megatron import MegatronExtractor

            device = next(self.model.parameters()).device
            dtype = getattr(torch, self.engine_dtype)
            if self.runtime.tp_group is not None or not _one_process():
                # several ranks build it together (it exchanges metadata): anew each sync, on every rank
                return MegatronExtractor(self._host_params(), dtype=dtype, device=device, **self._extractor_args,
                                         **slices)
            # One rank: what needs no work is a view of the backup, which the transport uploads
            # straight into its buffer (an upload, a cat of linear_fc1's halves and a pack copy
            # per tensor before: 1.64 x the link's floor at Qwen2-1.5B on an H100), and the
            # extractor is built once while the saver keeps its backups in place.
            return self._kept_host_extractor(lambda: MegatronExtractor(
                self._host_params(), dtype=dtype, upload_to=device, **self._extractor_args))
        return self._whole_extractor if whole else self._extractor

    def num_params(self) -> int:
        # the full model's, vocabulary padding left out (this rank holds a shard)
        return sum(math.prod(s.shape) for s in self._hf_extractor.specs())

    def close(self) -> None:
        """Tear down the process groups and parallel state this trainer set up. Idempotent."""
        self._stop_compute()
        self._cpu_twin = None
        if self._flat is not None:
            self._flat.close()
        self.runtime.close()

    def _weights_buffer(self) -> Any:
        return self._flat

    def _host_key(self) -> tuple | None:
        if self._flat is None:
            return super()._host_key()
        # the flat buffer's host backup is made at its first pause and kept at its address
        host = self._flat.host
        return None if host is None else (id(self._flat), host.data_ptr())

    # -- the learning ----------------------------------------------------------
    def _sequence_logits(self, seq: torch.Tensor) -> torch.Tensor:
        self.model.train()
        return self.forward(seq)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``GPTModel.forward`` on ``[batch, seq]`` token ids: logits ``[batch, seq, vocab]``."""
        b, s = tokens.shape
        position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        # Causal, given explicitly (True = masked, megatron's convention): with
        # attention_mask=None the local spec builds the same mask, but on "cuda".
        mask = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1)[None, None]
        logits = self.model(input_ids=tokens, position_ids=position_ids, attention_mask=mask)
        if self.runtime.tp_group is not None:
            logits = _GatherVocab.apply(logits, self.runtime.tp_group)
        return logits[..., :self.hf_config.vocab_size]  # Megatron's vocabulary padding (TP > 1)

    def _clip_grads(self) -> None:
        """Clip by the norm of the whole model's gradient, as one rank does.

        megatron-core's recipe (``optimizer/clip_grads.py``, whose code allocates on
        "cuda"): each rank sums the squares of its shards' gradients, a parameter
        every tensor-parallel rank holds whole (norms) counted on one rank only,
        and the sums are all-reduced over the tensor-parallel group. Those
        duplicates' gradients are equal on every rank (their inputs' gradients
        were all-reduced in the backward), so every rank scales by the same factor.
        """
        if self.runtime.tp_group is None:
            return super()._clip_grads()
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        group = self.runtime.tp_group
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        counted = [p.grad for p in self.model.parameters()
                   if p.grad is not None and param_is_not_tensor_parallel_duplicate(p, tp_group=group)]
        squares = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        for g in counted:
            squares += g.detach().float().pow(2).sum()
        dist.all_reduce(squares, group=group)
        # torch.nn.utils.clip_grad_norm_'s coefficient, so TP=N scales as TP=1 does
        coef = (self.config.grad_clip / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.dtype))

    # -- verification ----------------------------------------------------------
    def _host_params(self) -> dict[str, torch.Tensor]:
        """The pinned host backup of every (paused) parameter, with megatron's
        parallel attributes, which the extractor plans from."""
        out = {}
        flat_host = self._flat.host_tensors() if self._flat is not None else None
        for name, p in self.model.named_parameters():
            view = flat_host[name] if flat_host is not None else self._memory_backend.saver.host_view(p)
            for attr in _PARALLEL_ATTRS:
                if hasattr(p, attr):
                    setattr(view, attr, getattr(p, attr))
            out[name] = view
        return out

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Every parameter as one full tensor (the trainer's dtype) under its HF name, through the
        extractor the sync uses (so the digest compares like with like)."""
        if self._paused():
            # the device pages are unmapped: read the pinned host backup instead
            from colo.extractors.megatron import MegatronExtractor

            # with TP > 1 the shards are gathered on the device (an NCCL group
            # there), then brought back to the host
            device = next(self.model.parameters()).device if self.runtime.tp_group is not None else None
            ex = MegatronExtractor(self._host_params(), dtype=None, device=device, **self._extractor_args)
            return {name: t.detach().cpu() for name, t in ex.extract([s.name for s in ex.specs()])}
        ex = self._hf_extractor
        return {name: t.detach() for name, t in ex.extract([s.name for s in ex.specs()])}

    @torch.no_grad()
    def logits(self, tokens: list[list[int]]) -> torch.Tensor:
        if self._paused():
            # Touching the paused model would read unmapped device memory; a CPU
            # GPTModel beside a CUDA one would need the CPU workarounds, which are
            # process-wide. The transformers model of the architecture, fed the host backup,
            # computes the same function (a test checks the two agree).
            if self._cpu_twin is None:
                from colo.trainers.models import model_class

                self._cpu_twin = model_class(self.hf_config)(self.hf_config).eval()
            state = self.hf_state()
            missing, unexpected = self._cpu_twin.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if gpt_dims(self.hf_config)["tied"] else set()
            if set(missing) - tied or unexpected:
                raise RuntimeError(f"megatron trainer: HF twin state mismatch: missing {missing}, "
                                   f"unexpected {unexpected}")
            return self._cpu_twin(torch.tensor(tokens, dtype=torch.long)).logits.float()
        self.model.eval()
        device = next(self.model.parameters()).device
        return self.forward(torch.tensor(tokens, dtype=torch.long, device=device)).float().cpu()


class _GatherVocab(torch.autograd.Function):
    """All-gather vocabulary-parallel logits along the last dim; the backward keeps this
    rank's slice of the gradient. megatron's ``gather_from_tensor_model_parallel_region``
    does the same but allocates its output on the current CUDA device: not on a CPU.
    Every rank computes the same loss from the same full logits, so the slice is
    the whole gradient of its shard."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = grad.chunk(dist.get_world_size(ctx.group), dim=-1)
        return parts[dist.get_rank(ctx.group)].contiguous(), None


def _check_readback(trainer: MegatronTrainer, hf: Mapping[str, torch.Tensor]) -> None:
    """What the extractor reads back must be exactly what was written: the inverse
    layout (megatron_from_hf) and the extractor's rules agree, at every build."""
    got = trainer.hf_state()
    if set(got) != set(hf):
        raise RuntimeError(f"megatron trainer: the extractor gives {sorted(set(got) ^ set(hf))} "
                           f"on one side only of the HF names")
    bad = [n for n, t in got.items() if not torch.equal(t.cpu(), hf[n])]
    if bad:
        raise RuntimeError(f"megatron trainer: the extractor reads back different values for {bad}")


def build(*, model_config: Any, seed: int, engine_dtype: str, device: str,
          param_dtype: str | None = None, optimizer_state: bool = True,
          reference_init: bool = True, checkpoint: str | None = None) -> tuple[MegatronTrainer, Any]:
    """The megatron-core trainer, starting from the reference trainer's initial weights for
    ``seed`` (rounded to ``param_dtype``, :func:`~colo.trainers.base.param_dtype_for`:
    on a GPU the engine's, bf16, with fp32 master weights in the optimizer, as
    megatron's own bf16 training keeps them): this rank of TP=N when
    torch.distributed is initialised with N ranks (see the module docstring), else
    one rank. On a GPU its weights and AdamW state live in memory-saver regions with
    a pinned host backup, so offload and onload are real pauses. Call ``close()``
    when done. ``optimizer_state=False``: AdamW's state is left unmade (a trainer that
    only syncs: :mod:`colo.apps.bench_trainers`). ``reference_init=False``: megatron's own
    random init stays (a trainer whose values nobody compares with the reference, as
    the multi-GPU benchmark's, which checks the engine against this trainer's own
    tensors): the reference model is never built, which at Qwen2-7B is 30 GB of fp32
    initialised on the CPU by every rank before its first sync.) ``checkpoint``: the weights
    are that local Hugging Face directory's (read by transformers, written into the Megatron
    layout), not the reference initialisation."""
    from colo.trainers.models import initial_model
    from colo.trainers.precision import cast_parameters

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    dtype = param_dtype_for(param_dtype, engine_dtype, device)
    # refuse an unsupported config before any process group or parallel state exists
    check_tensor_parallel(model_config, dist.get_world_size() if dist.is_initialized() else 1)
    # named_parameters, not state_dict: a tied lm_head is listed once, as embed_tokens
    hf = None
    if reference_init or checkpoint is not None:
        hf = {n: p.detach().to(dtype) for n, p in initial_model(model_config, seed, checkpoint).named_parameters()}
    runtime = MegatronRuntime(device, seed=seed)
    try:
        if device == "cpu":
            model = cast_parameters(build_gpt(model_config, device="cpu", params_dtype=dtype), dtype)
            if hf is not None:
                load_hf(model, hf, model_config)
            trainer = MegatronTrainer(model, hf_config=model_config, runtime=runtime, engine_dtype=engine_dtype)
            if hf is not None:
                _check_readback(trainer, hf)
            return trainer, None
        from colo.device.cuda_memory import Saver, TrainerMemory

        saver = Saver()
        # One rank: the parameters are adopted into one flat buffer that pauses itself (one
        # copy to a kept pinned backup), as the hf trainer's are; the memory saver's region
        # paused its allocations one by one (Megatron's pause 0.93 of the link where hf's
        # reached 0.97; one H200, issue 44). With TP > 1, each rank's shards in a region.
        one_rank = runtime.tp_group is None and _one_process()
        with saver.region("trainer.weights", cpu_backup=True) if not one_rank else contextlib.nullcontext():
            # The local spec's RMSNorm is torch's own, built on the CPU whatever
            # use_cpu_initialization says (megatron's scripts call .cuda() after):
            # move everything onto the GPU inside the region.
            model = build_gpt(model_config, device="cuda", params_dtype=dtype).cuda(torch.cuda.current_device())
            model = cast_parameters(model, dtype)  # the norms too (torch's own RMSNorm is built in fp32)
            if hf is not None:
                load_hf(model, hf, model_config)
        flat = None
        if one_rank:
            from colo.device.flat_weights import FlatWeights

            flat = FlatWeights.adopt(model, device="cuda")
            torch.cuda.empty_cache()  # the parameters as built, copied into the buffer: back to the driver
        trainer = MegatronTrainer(model, hf_config=model_config, runtime=runtime, engine_dtype=engine_dtype,
                                  memory_backend=TrainerMemory(saver, flats={"weights": flat} if flat else None),
                                  flat=flat)
        if optimizer_state:
            with saver.region("trainer.optimizer", cpu_backup=True):
                trainer.init_optimizer_state()
        if hf is not None:
            _check_readback(trainer, hf)
        return trainer, saver
    except BaseException:
        runtime.close()
        raise
