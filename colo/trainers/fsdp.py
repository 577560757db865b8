"""The FSDP2 trainer: the reference trainer's model, optimizer and step, with ``fully_shard``.

Every decoder layer and then the root of the transformers model (a local checkpoint's,
or the demo's ``Qwen2ForCausalLM``) are wrapped with ``torch.distributed.fsdp.fully_shard``: each parameter becomes a
DTensor sharded on dim 0 over the data-parallel mesh, the forward and backward
all-gather and reduce-scatter, and AdamW steps the local shards. The REINFORCE
step and the AdamW configuration are :class:`~colo.trainers.hf.ReferenceTrainer`'s.

The sync goes through :class:`~colo.extractors.fsdp.FSDPExtractor`, so what the
engine receives is the DTensor gather (``full_tensor()``) of the live shards.
Gathering is a collective: on more than one rank, every rank calls
``extractor().extract``, ``hf_state()`` and ``logits()`` with the same arguments.

With N ranks it is data parallel too: a step's rank r takes the batch rows
``r::N`` (as the reference trainer does over N ranks), and FSDP2's
reduce-scatter of the gradients makes the one-rank full-batch step.

In a launcher's N-rank world (set up before :func:`build`) it shards over
that world and leaves the world to the launcher. In ``colo demo`` the trainer
is one rank (world size 1) in the demo's process: :func:`build` starts the
default process group (gloo on the CPU, NCCL on a GPU) unless one exists, and
:meth:`FSDPTrainer.close` ends the group it started.
On a GPU the shards and AdamW's state live in memory-saver regions with a
pinned host backup, as the reference trainer's weights do; on one rank, where
each shard is its whole tensor, the shards are one flat buffer the engine reads
straight from (:func:`adopt_shards`), as the reference trainer's parameters are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from colo.extractors.fsdp import FSDPExtractor
from colo.trainers.hf import ReferenceTrainer, ReinforceConfig


def shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, ``lm_head``).

    One parameter group per layer is what lets FSDP2 free a layer's gathered
    weights as soon as its forward (and backward) is done. Parameters on the
    CPU are moved to the mesh's device group by group, so a GPU never holds
    more than one layer's unsharded copy beside the shards.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _reshard(model: torch.nn.Module) -> None:
    """Free every gathered (unsharded) parameter: the root keeps its own after a
    forward until the backward, and a forward without backward (``logits``) has none."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _local_shard(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard as it lies: DTensor keeps it as ``_local_tensor``, which
    ``to_local()`` returns through an autograd function (host work per tensor that a
    sync's extractor check pays on every parameter); ``to_local()`` where that attribute
    is not there."""
    local = getattr(p, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else p.to_local()


class _LocalShards(Mapping):
    """Name -> each parameter's local shard as the DTensor holds it *now* (what
    :meth:`colo.device.flat_weights.FlatWeights.check` must find still in the buffer): a
    shard FSDP2 rebinds to other storage shows there, by name."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._params = params

    def __getitem__(self, name: str) -> torch.Tensor:
        return _local_shard(self._params[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def adopt_shards(model: torch.nn.Module, device: str) -> Any:
    """A one-rank ``fully_shard``-ed model's local shards moved into one
    :class:`~colo.device.flat_weights.FlatWeights` buffer on ``device``: their storage
    from now on, as :func:`colo.trainers.hf.build` adopts a plain model's parameters.

    Why: on one rank each shard is its whole tensor, so the engine can read the
    weights straight out of the trainer's memory (the packed transport's one-copy
    sync: no gather, no pack, one handle), and the memory backend pauses and resumes
    them as one copy of one buffer, not an allocation at a time (the memory saver's
    338 at Qwen2-1.5B kept fsdp's pause at 0.92 of the link where hf's, one buffer,
    reached 0.97; one H200, issue 44).

    How: each parameter is swapped (``torch.utils.swap_tensors``, what ``nn.Module._apply``
    does for a DTensor) for a DTensor of the same mesh, placements, shape and stride
    over its view of the buffer, through FSDP2's own ``_apply``, which then points
    each ``FSDPParam``'s all-gather input (``_sharded_param_data``) at the new local
    shard (``reset_sharded_param``): the forward reads the buffer and the optimizer
    writes into it. The old shards are freed once nothing holds them."""
    from torch.distributed.tensor import DTensor

    from colo.device.flat_weights import FlatWeights

    _reshard(model)  # a forward leaves the root's parameters gathered (plain tensors)
    params = dict(model.named_parameters())  # a tied parameter once, under its first name
    if not params or not all(isinstance(p, DTensor) and p.device_mesh.size() == 1 for p in params.values()):
        raise ValueError("adopt_shards: expected a model fully_shard-ed over a one-rank mesh (every parameter a "
                         "DTensor whose mesh has one rank)")
    shards = {n: _local_shard(p).detach() for n, p in params.items()}
    if any(tuple(t.shape) != tuple(params[n].shape) for n, t in shards.items()):
        raise ValueError("adopt_shards: a local shard is not its whole parameter (padded?); one rank expected")
    flat = FlatWeights.from_tensors(shards, device=device)
    del shards
    name_of = {id(p): n for n, p in params.items()}

    def into_flat(t: torch.Tensor) -> torch.Tensor:
        name = name_of.get(id(t))
        if name is None:
            return t  # a buffer (rotary frequencies): not a weight, left where it is
        return DTensor.from_local(flat.tensors[name], t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())

    model._apply(into_flat)
    flat.track(_LocalShards(params))
    flat.check()  # every shard is its view of the buffer now, or this says which is not
    return flat


def _unsharded_class(model: torch.nn.Module) -> type:
    """The model's own class: ``fully_shard`` swaps in a subclass with ``FSDPModule`` mixed in."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__
                if issubclass(c, torch.nn.Module) and not issubclass(c, FSDPModule))


def _shard_from_host(t: torch.Tensor, host_view: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The DTensor ``t`` rebuilt from its local shard's host backup, uploaded to ``t``'s device.

    The paused shard's device pages are unmapped; its pinned host backup holds
    the same bytes. Uploading the shard and gathering it on the device is the
    same collective as gathering the live shard, on every rank.
    """
    from torch.distributed.tensor import DTensor

    local = t.to_local()
    if local.numel() == 0:
        # a rank whose shard of a short dim 0 is empty has no backup to view
        dev = torch.empty(local.shape, dtype=local.dtype, device=local.device)
    else:
        host = host_view(local)
        dev = host.to(local.device, non_blocking=host.is_pinned())
    return DTensor.from_local(dev, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


class _HostShardExtractor(FSDPExtractor):
    """``FSDPExtractor`` over paused shards: each tensor is uploaded from its host
    backup when its bucket is built, then gathered with ``full_tensor()``."""

    def __init__(self, module: torch.nn.Module, host_view: Callable[[torch.Tensor], torch.Tensor], *,
                 dtype: Any, device: torch.device):
        # ``device`` tells the transport where this source's tensors are built
        # (it uploads and packs them on its own stream there).
        super().__init__(module, dtype=dtype, device=device)
        self._host_view = host_view

    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = _shard_from_host(t, self._host_view)
        return super()._full(name, t)


class FSDPTrainer(ReferenceTrainer):
    """The reference trainer over a ``fully_shard``-ed model (see :func:`shard`).

    ``memory_backend`` is as for :class:`ReferenceTrainer` (``None`` on the CPU).
    ``group`` is the process group this trainer started and must end in
    :meth:`close` (``None``: the caller owns the process group). ``flat_weights``: on one
    rank, the buffer the local shards were adopted into (:func:`adopt_shards`), read by
    the engine and paused as :class:`ReferenceTrainer`'s.
    """

    def __init__(self, model: torch.nn.Module, *, engine_dtype: str = "bfloat16",
                 config: ReinforceConfig | None = None, memory_backend: Any = None,
                 group: _OwnedProcessGroup | None = None, flat_weights: Any = None):
        from torch.distributed.tensor import DTensor

        if not any(isinstance(p, DTensor) for p in model.parameters()):
            raise TypeError("FSDPTrainer: the model has no sharded parameters; apply shard(model, mesh) first")
        super().__init__(model, engine_dtype=engine_dtype, config=config, memory_backend=memory_backend,
                         flat_weights=flat_weights)
        self._group = group
        #: (the shards' addresses, the one-rank resident extractor over them): see extractor()
        self._resident_extractor: tuple[tuple, Any] | None = None
        #: the one-rank resident extractor over the flat buffer's views: see extractor()
        self._flat_extractor: Any = None
        # kept: between a forward and its backward the root's parameters are plain tensors
        self._mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh

    def _live_extractor(self) -> Any:
        return FSDPExtractor(self.model, dtype=getattr(torch, self.engine_dtype))

    def _new_cpu_twin(self) -> torch.nn.Module:
        return _unsharded_class(self.model)(self.model.config).eval()

    @property
    def world_size(self) -> int:
        return self._mesh.size()

    # -- TrainerSide -----------------------------------------------------------
    def tag_bytes(self) -> dict[str, int]:
        if self.flat_weights is not None:
            return super().tag_bytes()  # one rank: each shard its whole tensor, in the buffer
        # What this rank keeps resident: its shard of each parameter, padded to
        # an even split of dim 0 as FSDP2 stores it.
        world = self.world_size
        weights = sum(math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) * p.element_size()
                      for p in self.model.parameters())
        return {"weights": weights, "optimizer": self._optimizer_bytes(weights)}

    def extractor(self) -> Any:
        if self._paused() and self.world_size == 1 and next(iter(self.model.parameters())).device.type == "cuda":
            # Paused on one rank, each shard is its whole tensor and its pinned host backup is
            # the source as it lies (hf_state's views): the reference trainer's host extractor,
            # uploaded straight into staging with no per-tensor upload, gather and pack copy
            # (3 device passes and an allocation per tensor: 5.4 x the link's floor at
            # Qwen2-1.5B on an H100), built once while the saver keeps its backups in place.
            return super().extractor()
        if self._paused():
            # offload-first on a GPU: the shards are paused; upload each from its
            # pinned host backup as its bucket is built, then gather it.
            device = next(iter(self.model.parameters())).device
            return _HostShardExtractor(self.model, self._memory_backend.saver.host_view,
                                       dtype=getattr(torch, self.engine_dtype), device=device)
        # A new extractor per sync: FSDP2's lazy init (first forward) may rebind
        # a parameter's local shard to new storage; an extractor built before it
        # would read the initial weights. Seen on an H100: sync-first sent the
        # step-0 weights while hf_state() had the trained ones.
        if self.flat_weights is not None:
            # one rank, the shards adopted into the flat buffer: its views are their storage
            # for as long as check() finds every shard there, so one extractor over the views
            # serves every sync, and the packed transport's one-copy layout is walked once.
            # Rebuilding it (the reshard, 338 shards' addresses) was the 1.7-3.1 ms "gather"
            # of a one-copy sync-first sync at Qwen2-1.5B / 7B on an H200 (issue 44), where
            # hf's, built once, took 0.01 ms
            self.flat_weights.check()
            if self._flat_extractor is None:
                from colo.extractors.plain import PlainExtractor

                self._flat_extractor = PlainExtractor(dict(self.flat_weights.tensors),
                                                      dtype=getattr(torch, self.engine_dtype))
            return self._flat_extractor
        if self.world_size == 1:
            # one rank: each local shard is the whole tensor, read as a plain tensor; the
            # DTensor path dispatched several ops per tensor (gather included) for nothing:
            # 137 ms for a Qwen2-1.5B sync-first on an H100, 65 x one device copy (on the
            # CPU the same, which is also where this path is tested)
            from colo.extractors.plain import PlainExtractor

            _reshard(self.model)
            shards = [(n, _local_shard(p)) for n, p in self.model.named_parameters()]
            # Kept while every shard is the same storage (FSDP2's lazy init rebinding one shows
            # as a new address): building it anew each sync (338 to_local() calls and specs)
            # was most of a one-rank sync-first gather, 14 ms at Qwen2-1.5B on an H200
            # (issue 44), and the same extractor's tensors let its request memo replay them.
            key = tuple((n, t.data_ptr()) for n, t in shards)
            if self._resident_extractor is None or self._resident_extractor[0] != key:
                local = {n: t.detach() for n, t in shards}
                self._resident_extractor = (key, PlainExtractor(local, dtype=getattr(torch, self.engine_dtype)))
            return self._resident_extractor[1]
        return self._live_extractor()

    @staticmethod
    def _stored(p: torch.Tensor) -> torch.Tensor:
        return p.to_local()

    def _data_parallel(self) -> tuple[int, int, Any]:
        return self._mesh.get_local_rank(), self._mesh.size(), self._mesh.get_group()

    def _backward(self, loss: torch.Tensor) -> None:
        # FSDP2 averages the ranks' gradients; the full batch's is their sum
        # (one rank: a scale of 1, the step is the reference trainer's).
        (loss * self.world_size).backward()

    def _restore(self, saved: Any) -> None:
        _reshard(self.model)  # a step that failed mid-way may have left groups gathered (plain tensors)
        super()._restore(saved)

    def _reinforce(self, data: Any) -> dict[str, float]:
        try:
            return super()._reinforce(data)
        finally:
            _reshard(self.model)

    # -- verification ----------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        """Every parameter as one full tensor under its HF name, in the trainer's dtype.

        A collective on more than one rank. While paused with one rank, the
        shard is the whole tensor and its pinned host backup is read in place
        (no device memory); with more ranks each tensor is uploaded, gathered
        and copied back to the host in turn.
        """
        if self._paused() and self.flat_weights is not None:
            return self.flat_weights.host_tensors()  # named as named_parameters() names them
        if self._paused():
            params = {n: p.detach() for n, p in self.model.named_parameters()}
            host_view = self._memory_backend.saver.host_view
            if self.world_size == 1:
                return {n: host_view(p.to_local()) for n, p in params.items()}
            return {n: _shard_from_host(p, host_view).full_tensor().cpu() for n, p in params.items()}
        # A parameter group left gathered holds plain tensors in place of its DTensors.
        _reshard(self.model)
        if self.world_size == 1:
            # one rank: the local shard is the whole tensor, aliased as the reference trainer's
            # hf_state aliases its parameters; full_tensor() would dispatch a redistribution per
            # tensor for nothing (the trainer's side of a sync-first verification, which reads
            # this, took 57 ms at Qwen2-1.5B on an H200 against hf's 15)
            return {n: _local_shard(p).detach() for n, p in self.model.named_parameters()}
        return {n: p.detach().full_tensor() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def logits(self, tokens: list[list[int]]) -> torch.Tensor:
        try:
            return super().logits(tokens)
        finally:
            if not self._paused():
                _reshard(self.model)

    # -- teardown --------------------------------------------------------------
    def close(self) -> None:
        """End the process group :func:`build` started (idempotent). The trainer's
        collectives (training, ``hf_state``, the sync) cannot run afterwards."""
        self._stop_compute()
        if self.flat_weights is not None:
            self.flat_weights.close()
        group, self._group = self._group, None
        if group is not None:
            group.close()


class _OwnedProcessGroup:
    """A one-rank default process group. Its store is a TCPStore on 127.0.0.1 at a
    port the kernel picks (no port to guess, no file left behind if nobody closes it)."""

    def __init__(self, device: str):
        store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
        if device == "cuda":
            dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def build(*, model_config: Any, seed: int, engine_dtype: str, device: str,
          param_dtype: str | None = None, optimizer_state: bool = True,
          checkpoint: str | None = None) -> tuple[FSDPTrainer, Any]:
    """The FSDP2 trainer over the default process group (started here, one rank, if
    none exists: the caller must then call ``trainer.close()``).

    Its sharded parameters are in ``param_dtype``
    (:func:`~colo.trainers.base.param_dtype_for`: on a GPU the engine's, bf16, with
    fp32 masters of the shards in the optimizer), as an FSDP2 trainer without a
    mixed-precision policy keeps them.

    On a GPU the shards and AdamW's state live in memory-saver regions with a
    pinned host backup, so offload and onload are real pauses (as in
    :func:`colo.trainers.hf.build`); on one rank with shards in the engine's dtype the
    shards are one :class:`~colo.device.flat_weights.FlatWeights` buffer instead
    (:func:`adopt_shards`), paused by itself to a shared pinned host backup.
    ``optimizer_state=False``: AdamW's state is left unmade (a trainer that only syncs:
    :mod:`colo.apps.bench_trainers`). ``checkpoint``: the model sharded is that local Hugging
    Face directory's (``from_pretrained``, every rank reading it), not ``model_config``'s at
    random.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from colo.trainers.base import param_dtype_for
    from colo.trainers.models import initial_model
    from colo.trainers.precision import cast_parameters

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    dtype = param_dtype_for(param_dtype, engine_dtype, device)
    saver = None
    if device == "cuda":
        from colo.device.cuda_memory import Saver

        saver = Saver()  # first: it refuses expandable segments before anything is allocated
    group = None if dist.is_initialized() else _OwnedProcessGroup(device)
    try:
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        # one rank with shards in the engine's dtype: the shards are adopted into one buffer
        # the engine reads straight from (adopt_shards), as the reference trainer's parameters
        one_copy = mesh.size() == 1 and dtype == getattr(torch, engine_dtype)
        if saver is None:
            model = shard(cast_parameters(initial_model(model_config, seed, checkpoint), dtype), mesh)
            flat = adopt_shards(model, "cpu") if one_copy else None
            return FSDPTrainer(model, engine_dtype=engine_dtype, group=group, flat_weights=flat), None
        from colo.device.cuda_memory import TrainerMemory

        if one_copy:
            model = shard(cast_parameters(initial_model(model_config, seed, checkpoint), dtype), mesh)
            flat = adopt_shards(model, "cuda")
            torch.cuda.empty_cache()  # the shards fully_shard made, copied into the buffer: back to the driver
            memory = TrainerMemory(saver, flats={"weights": flat})
        else:
            # fully_shard moves each group's parameters to the GPU and copies them
            # into their shards here: the shards are the region's allocations.
            flat = None
            with saver.region("trainer.weights", cpu_backup=True):
                model = shard(cast_parameters(initial_model(model_config, seed, checkpoint), dtype), mesh)
            memory = TrainerMemory(saver)
        trainer = FSDPTrainer(model, engine_dtype=engine_dtype, memory_backend=memory, group=group,
                              flat_weights=flat)
        if optimizer_state:
            with saver.region("trainer.optimizer", cpu_backup=True):
                trainer.init_optimizer_state()
        return trainer, saver
    except BaseException:
        if group is not None:
            group.close()
        raise


__all__ = ["FSDPTrainer", "adopt_shards", "build", "shard"]
