"""A local Hugging Face checkpoint directory, checked before anything loads it.

What colo takes as a model is what ``save_pretrained`` writes: a directory holding
``config.json`` and the weights as ``*.safetensors`` (one file or shards). Before a
trainer loads one or an engine starts from one, :func:`inspect` reads the config and
the safetensors headers (JSON at the start of each file: no tensor is read) and refuses,
in one line naming the directory:

- a path that does not exist or is not a directory;
- a directory without ``config.json`` (not a Hugging Face checkpoint), or an unreadable one;
- an architecture colo's table (:mod:`colo.models.arch`) does not have;
- weights that are not exactly the tensors the table gives for that config: a missing
  tensor (transformers would initialise it at random and say so only in a log line),
  an extra one, or a shape that differs.

Nothing is downloaded: a path is a directory on this machine. Pure: no torch, no anyio.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from colo.core.errors import CheckpointError
from colo.models.arch import Arch, arch_of, hf_shapes

#: tensors some checkpoints carry that are no weight (buffers older transformers saved);
#: vLLM's and SGLang's loaders skip them, so does the check
NOT_WEIGHTS = ("rotary_emb.inv_freq",)
#: how many names of each kind a refusal lists before it says how many more there are
LISTED = 4


@dataclass(frozen=True)
class Checkpoint:
    """A checked checkpoint directory: its config (``config.json`` as read), architecture,
    and every tensor in its safetensors files, name -> (shape, dtype as safetensors writes it)."""

    path: str
    config: dict
    arch: Arch
    tensors: dict


def read_config(path: Any) -> tuple[dict, Arch]:
    """``config.json`` of the checkpoint at ``path`` and its architecture; a
    :class:`~colo.core.errors.CheckpointError` or ``UnsupportedArchitecture`` otherwise."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise CheckpointError(f"a checkpoint is a directory path, got {path!r}")
    where = str(path)
    if not os.path.exists(where):
        raise CheckpointError(f"checkpoint {where!r} does not exist (colo loads local directories only: "
                              f"nothing is downloaded)")
    if not os.path.isdir(where):
        raise CheckpointError(f"checkpoint {where!r} is not a directory; expected a Hugging Face checkpoint "
                              f"directory (config.json and *.safetensors, as save_pretrained writes)")
    cfg_path = os.path.join(where, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"checkpoint {where!r} has no config.json: not a Hugging Face checkpoint directory")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {where!r}: config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {where!r}: config.json holds {type(config).__name__}, expected an object")
    if "model_type" not in config:
        # a Hugging Face config always names it; without it colo could only guess
        raise CheckpointError(f"checkpoint {where!r}: config.json has no model_type")
    return config, arch_of(config, what=f"checkpoint {where!r}")


def safetensors_header(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor in one safetensors file, from its header alone:
    8 bytes of little-endian length, then that much JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 << 20:
                raise ValueError(f"header length {n} is not plausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path!r} is not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path!r} is not a readable safetensors file (its header is not an object)")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = (tuple(int(s) for s in meta["shape"]), str(meta["dtype"]))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path!r}: the header entry of {name!r} has no shape and dtype") from None
    return out


def inspect(path: Any) -> Checkpoint:
    """The checked checkpoint at ``path`` (see the module docstring for what is refused)."""
    config, arch = read_config(path)
    where = str(path)
    files = sorted(glob.glob(os.path.join(glob.escape(where), "*.safetensors")))
    if not files:
        raise CheckpointError(f"checkpoint {where!r} holds no *.safetensors files (colo reads the safetensors "
                              f"weights save_pretrained writes by default)")
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        for name, meta in safetensors_header(f).items():
            if name in tensors:
                raise CheckpointError(f"checkpoint {where!r}: {name} is in more than one safetensors file")
            tensors[name] = meta
    try:
        want = hf_shapes(config, what=f"checkpoint {where!r}")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    weights = {n: m for n, m in tensors.items() if not n.endswith(NOT_WEIGHTS)}
    missing = [n for n in want if n not in weights]
    extra = [n for n in weights if n not in want]
    wrong = [f"{n} {weights[n][0]} (the config gives {s})" for n, s in want.items()
             if n in weights and weights[n][0] != s]
    problems = [f"{label} {_some(items)}" for label, items in (("missing", missing), ("unexpected", extra),
                                                                ("wrong shape:", wrong)) if items]
    if problems:
        raise CheckpointError(f"checkpoint {where!r} ({config['model_type']}) does not hold the tensors its "
                              f"config.json gives: " + "; ".join(problems))
    return Checkpoint(where, config, arch, tensors)


def _some(items: list[str]) -> str:
    shown = ", ".join(items[:LISTED])
    return shown + (f" and {len(items) - LISTED} more" if len(items) > LISTED else "")


__all__ = ["Checkpoint", "inspect", "read_config", "safetensors_header"]
