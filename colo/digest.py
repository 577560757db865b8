"""The digest every engine can pass: of exactly the HF-named tensors it received.

A sync is verified by comparing what the engine says it received with what
the trainer sent. Engines fuse and repack what they receive (colo's engine
into ``qkv_proj``, vLLM on a CPU into oneDNN handles whose parameters are
then empty), so the digest is not of the engine's parameters but of the
tensors as they arrived, under their HF names:

- each tensor's entry is ``sha256(header + sha256(bytes))``, the header being
  its name, dtype and shape (length-prefixed JSON), the bytes its row-major
  bytes in the engine's dtype; a tensor that arrives in pieces is hashed piece
  by piece, in order, to the same value;
- the digest is ``sha256`` over the entries **in the trainer's spec order**
  (the order of the spec list the engine accepted at preflight).

So one flipped bit in any tensor, a missing tensor, an extra one, a changed
shape or dtype, or tensors swapped between names all change it. The trainer
side computes it over its own tensors with :func:`weights_digest`; an engine
records what it receives with :class:`ReceivedDigest`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from colo.dtypes import dtype_name


def _header(name: str, dtype: str, shape: Sequence[int]) -> bytes:
    header = json.dumps([name, dtype, [int(s) for s in shape]]).encode()
    return len(header).to_bytes(8, "little") + header


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The row-major bytes of ``t`` on the host (a copy only where ``t`` is elsewhere or strided)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class TensorHash:
    """One tensor's entry, fed its bytes in order (whole, or piece after piece)."""

    __slots__ = ("name", "dtype", "shape", "_bytes", "_seen", "_total")

    def __init__(self, name: str, dtype: str, shape: Sequence[int], nbytes: int):
        self.name, self.dtype, self.shape = name, dtype, tuple(int(s) for s in shape)
        self._bytes = hashlib.sha256()
        self._seen, self._total = 0, int(nbytes)

    def update(self, data: torch.Tensor) -> None:
        raw = _host_bytes(data)
        self._bytes.update(raw)
        self._seen += len(raw)

    @property
    def complete(self) -> bool:
        return self._seen == self._total

    def entry(self) -> bytes:
        if not self.complete:
            raise ValueError(f"{self.name}: hashed {self._seen} of its {self._total} bytes")
        return hashlib.sha256(_header(self.name, self.dtype, self.shape) + self._bytes.digest()).digest()


def tensor_entry(name: str, tensor: torch.Tensor) -> bytes:
    """The entry of one whole tensor."""
    h = TensorHash(name, dtype_name(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())
    h.update(tensor)
    return h.entry()


def combine(entries: Iterable[bytes]) -> str:
    """The digest of entries, in the order given."""
    h = hashlib.sha256()
    for e in entries:
        h.update(e)
    return h.hexdigest()


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest of ``(HF name, tensor)`` pairs in the order given: what the trainer
    computes over the tensors it sends, converted to the engine's dtype."""
    return combine(tensor_entry(name, t) for name, t in named)


def expected_weights_digest(state: Mapping[str, torch.Tensor], order: Sequence[str], dtype: Any) -> str:
    """The digest an engine of ``dtype`` reports after receiving ``state`` under the spec
    list ``order`` (each tensor converted to the engine dtype on its own, as the sender does)."""
    missing = [n for n in order if n not in state]
    if missing:
        raise KeyError(f"the trainer has no tensor named {', '.join(missing[:5])}"
                       + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))
    return weights_digest((n, state[n].detach().to(dtype=dtype)) for n in order)


class ReceivedDigest:
    """An engine's record of the tensors it received in one sync, hashed as they arrive.

    ``add(name, tensor)`` takes a whole tensor or a piece (an object with ``data``,
    ``shape``, ``offset``, ``end``: :class:`colo.transports.wire.Piece`), pieces
    in order; :meth:`digest` combines the entries in the order asked for and
    names any tensor it did not (completely) receive.
    """

    def __init__(self) -> None:
        self._open: dict[str, TensorHash] = {}
        self._done: dict[str, bytes] = {}

    def clear(self) -> None:
        self._open.clear()
        self._done.clear()

    def add(self, name: str, tensor: Any) -> None:
        data = getattr(tensor, "data", tensor)
        if isinstance(tensor, torch.Tensor):
            self._done[name] = tensor_entry(name, tensor)
            return
        h = self._open.get(name)
        if h is None:
            numel = 1
            for s in tensor.shape:
                numel *= int(s)
            h = self._open[name] = TensorHash(name, dtype_name(data.dtype), tensor.shape,
                                               numel * data.element_size())
        h.update(data)
        if h.complete:
            self._done[name] = self._open.pop(name).entry()

    @property
    def names(self) -> list[str]:
        return list(self._done)

    def digest(self, order: Sequence[str]) -> str:
        missing = [n for n in order if n not in self._done]
        if missing:
            partial = [n for n in missing if n in self._open]
            raise ValueError(f"no complete tensor received under {len(missing)} name(s) of the spec list: "
                             f"{', '.join(missing[:5])}" + (f" ({', '.join(partial[:5])} only in part)" if partial else ""))
        return combine(self._done[n] for n in order)


__all__ = ["ReceivedDigest", "TensorHash", "combine", "expected_weights_digest", "tensor_entry", "weights_digest"]
