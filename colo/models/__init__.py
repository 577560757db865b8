"""The models colo syncs, as data: the architecture table (:mod:`colo.models.arch`) and
the checks of a local Hugging Face checkpoint directory (:mod:`colo.models.checkpoint`).
Pure: importing it imports no torch."""

from colo.models.arch import ARCHS, Arch, arch_of, hf_shapes, supported
from colo.models.checkpoint import Checkpoint, inspect, read_config

__all__ = ["ARCHS", "Arch", "Checkpoint", "arch_of", "hf_shapes", "inspect", "read_config", "supported"]
