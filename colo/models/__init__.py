"""The models colo syncs, as data: the architecture table (:mod:`colo.models.arch`), the
checks of a local Hugging Face checkpoint directory (:mod:`colo.models.checkpoint`) and of a
sync's spec list against a checkpoint's tensors (:mod:`colo.models.specs`). Engines,
trainers and apps read them from here.
Pure: importing it imports no torch."""

from colo.models.arch import ARCHS, Arch, arch_of, hf_shapes, supported
from colo.models.checkpoint import Checkpoint, inspect, read_config
from colo.models.specs import check_specs, hf_specs

__all__ = ["ARCHS", "Arch", "Checkpoint", "arch_of", "check_specs", "hf_shapes", "hf_specs", "inspect", "read_config",
           "supported"]
