"""``disk``: a safetensors checkpoint directory, written by the trainer, read by the engine.

SGLang's ``update_weights_from_disk`` (AReaL's choice): slower than handing
memory over, but the sync doubles as a checkpoint and any number of engines
can read it. Per bucket the sender writes one shard,
``<root>/.tmp-<uuid>/shard-<i>.safetensors``, and the engine loads it as soon
as it is written, while the next bucket is gathered and written.

Atomic on purpose: a crash never leaves a half checkpoint that looks
complete. Shards go into a hidden temporary directory; only after the engine
accepted the whole sync is ``manifest.json`` written — last — and fsynced,
the directory fsynced, and the directory renamed to ``<root>/step-<version>``
in one ``rename``. A directory named ``step-*`` with a manifest is complete;
anything else (a ``.tmp-*`` left by a killed process) is not, and
:func:`load_checkpoint` refuses it. A failed or cancelled sync removes its
temporary directory in shielded cleanup. Old checkpoints are renamed out of
the ``step-*`` namespace before they are deleted, for the same reason.

The engine opens only ``.tmp-<uuid>/shard-<n>.safetensors`` paths under the
root it was given at init (no ``..``, no symlinks, no absolute paths), and
reads them with safetensors, which holds no code — never ``torch.load``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from colo.core.buckets import Bucket, itemsize
from colo.core.interfaces import SyncContext
from colo.transports.base import BucketSender, RequestError, Staged, TensorMeta, get_field, parse_tensors
from colo.transports.pack import entry_bytes
from colo.transports.wire import piece_of
from colo.core.errors import IncompleteCheckpoint
from colo.proc.lifecycle import make_dir, release_dir

FORMAT = "colo.checkpoint/1"
MANIFEST = "manifest.json"
_TMP = re.compile(r"^\.tmp-[0-9a-f]{32}$")
_SHARD = re.compile(r"^shard-[0-9]{5}\.safetensors$")
_STEP = re.compile(r"^step-([0-9]+)$")


@dataclass(frozen=True)
class DiskInitInfo:
    """The checkpoint root; the engine reads shards from under it and nowhere else."""

    root: str

    def __post_init__(self) -> None:
        if not os.path.isabs(self.root):
            raise RequestError(f"checkpoint root must be an absolute path, got {self.root!r}")

    def to_json(self) -> dict:
        return {"root": self.root}

    @classmethod
    def from_json(cls, d: Any) -> DiskInitInfo:
        return cls(get_field(d, "root", str, "disk init info"))


@dataclass(frozen=True)
class DiskRequest:
    """One bucket: the shard's path relative to the root, and the tensors it must hold."""

    file: str
    tensors: tuple[TensorMeta, ...]

    def to_json(self) -> dict:
        return {"file": self.file, "tensors": [m.to_json() for m in self.tensors]}

    @classmethod
    def from_json(cls, d: Any) -> DiskRequest:
        return cls(get_field(d, "file", str, "disk request"), parse_tensors(d, "tensors", "disk request"))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(path: str, tensors: list[tuple[str, Any]], *, bucket: int, entries: Any = None) -> int:
    """One bucket as a safetensors file, fsynced; returns its size in bytes.

    With ``entries`` (the bucket's plan), a piece of a tensor larger than the
    bucket is stored under the tensor's name as a 1-D run of its elements; the
    request and the manifest say where it lies in the tensor."""
    from safetensors.torch import save

    entries = list(entries) if entries is not None else [None] * len(tensors)
    out = {}
    for (name, t), e in zip(tensors, entries):
        t = t.detach()
        if e is not None and not e.whole:
            # a copy of its own: safetensors writes whole storages, not a window into one
            t = entry_bytes(t, e).view(getattr(torch, e.spec.dtype)).clone()
        out[name] = t.contiguous().cpu()
    data = save(out, metadata={"format": FORMAT, "bucket": str(bucket)})
    write_durable(path, data)
    return len(data)


def _retire(path: str) -> None:
    """Take a checkpoint out of the ``step-*`` namespace in one rename, then delete it:
    a crash mid-delete leaves a hidden ``.old-*`` directory, never a gutted ``step-*``."""
    parent = os.path.dirname(path)
    trash = os.path.join(parent, f".old-{uuid.uuid4().hex}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Committed checkpoints under ``root`` as (version, path), oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = _STEP.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(root: str) -> str | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def remove_incomplete(root: str) -> list[str]:
    """Delete ``.tmp-*`` and ``.old-*`` leftovers of killed writers; returns what was removed.

    Only call this when no writer is running: a live sync's directory looks the same."""
    removed = []
    for name in sorted(os.listdir(root)):
        if _TMP.match(name) or name.startswith(".old-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise IncompleteCheckpoint(f"{path} has no {MANIFEST}: not a complete checkpoint "
                                   f"(a crashed or unfinished write)")
    with open(mpath, encoding="utf-8") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IncompleteCheckpoint(f"{mpath}: expected format {FORMAT!r}, got {manifest.get('format')!r}"
                                   if isinstance(manifest, dict) else f"{mpath}: not a JSON object")
    return manifest


def load_checkpoint(path: str, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a committed checkpoint, checked against its manifest."""
    from safetensors.torch import load_file

    manifest = read_manifest(path)
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}  # elements written so far of each tensor stored in pieces
    for shard in manifest["shards"]:
        fname = shard["file"]
        if not isinstance(fname, str) or not _SHARD.match(fname):
            raise IncompleteCheckpoint(f"{path}: manifest names a bad shard file {fname!r}")
        fpath = os.path.join(path, fname)
        if not os.path.isfile(fpath) or os.path.getsize(fpath) != shard["bytes"]:
            raise IncompleteCheckpoint(f"{fpath}: missing or not the {shard['bytes']} B the manifest records")
        got = load_file(fpath, device=str(device))
        # [name, shape, dtype] for a whole tensor, [name, shape, dtype, piece_offset] for a
        # piece of one larger than the bucket (stored 1-D: its elements from piece_offset on)
        rows = shard["tensors"]
        have = {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in got.items()}
        want = {r[0]: ((have.get(r[0], ((),))[0] if len(r) > 3 else tuple(r[1])), r[2]) for r in rows}
        if have != want or any(len(r) > 3 and len(have[r[0]][0]) != 1 for r in rows):
            raise IncompleteCheckpoint(f"{fpath}: tensors do not match the manifest")
        for row in shard["tensors"]:
            if len(row) <= 3:
                out[row[0]] = got[row[0]]
                continue
            name, shape, dtype, offset = row
            piece = got[name]
            if offset == 0:
                out[name] = torch.empty(tuple(shape), dtype=piece.dtype, device=piece.device)
                filled[name] = 0
            if filled.get(name) != offset // piece.element_size() \
                    or filled[name] + piece.numel() > out[name].numel():
                raise IncompleteCheckpoint(f"{fpath}: piece of {name!r} at byte {offset} does not follow "
                                           f"the pieces before it inside its {list(shape)}")
            flat = out[name].view(-1)
            flat[filled[name]:filled[name] + piece.numel()].copy_(piece)
            filled[name] += piece.numel()
    short = [n for n, k in filled.items() if k != out[n].numel()]
    if short:
        raise IncompleteCheckpoint(f"{path}: tensor(s) {short} are missing pieces")
    return out


class DiskTransport(BucketSender):
    name = "disk"

    def __init__(self, *, root: str | os.PathLike | None = None, keep: int = 2, pipelined: bool = True):
        super().__init__(pipelined=pipelined)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive number of checkpoints, got {keep!r}")
        self.keep = keep
        if root is None:
            # No root given (``colo demo --transport disk``): a private one that
            # goes with this sender. Give a root to keep the checkpoints. Made as
            # colo's other run dirs are, holding their owner's lock: a process killed
            # mid-sync leaves a model-sized dir that the next sweep can prove dead.
            root = make_dir("ckpt")
            self._finalizer: Any = weakref.finalize(self, release_dir, root)
        else:
            self._finalizer = None
            os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(os.fspath(root))
        self._engine_ready: Any = None
        self._tmp: str | None = None
        self._shards: list[dict] = []
        self.last_checkpoint: str | None = None

    async def _begin(self, engine: Any, ctx: SyncContext, buckets: list[Bucket]) -> None:
        if self._engine_ready is not engine:
            await engine.transport_init(self.name, STRATEGY.create_init_info(root=self.root).to_json())
            self._engine_ready = engine
        # created only now, after preflight: a refused sync writes nothing
        self._tmp = os.path.join(self.root, f".tmp-{uuid.uuid4().hex}")
        os.mkdir(self._tmp, 0o700)
        self._shards = []

    async def _pack(self, bucket: Bucket, tensors: list[tuple[str, Any]], slot: int, ctx: SyncContext) -> None:
        fname = f"shard-{bucket.index:05d}.safetensors"
        # the serialized shard is held in memory while it is written
        staged = Staged(ctx, bucket.payload_bytes)
        stream = self._stream  # the sender's upload stream, where the gather ran (None off the GPU)

        def write() -> int:
            if stream is not None:
                # The gather's uploads and conversions were queued on the upload stream;
                # serialising reads the tensors on this thread's stream, which does not
                # wait for it: on CUDA an offload-first sync wrote half-uploaded bytes.
                stream.synchronize()
            return write_shard(os.path.join(self._tmp, fname), tensors, bucket=bucket.index,
                               entries=bucket.entries)

        t0 = time.perf_counter()
        try:
            size = await anyio.to_thread.run_sync(write)
        finally:
            staged.free()
        self._shards.append({"file": fname, "bytes": size, "bucket": bucket.index,
                             "tensors": [[e.spec.name, list(e.spec.shape), e.spec.dtype]
                                         + ([] if e.whole else [e.offset]) for e in bucket.entries]})
        ctx.record(bucket.index, "pack", bucket.payload_bytes, len(tensors), time.perf_counter() - t0)

    async def _handoff(self, engine: Any, bucket: Bucket, slot: int, ctx: SyncContext) -> None:
        rel = os.path.join(os.path.basename(self._tmp), f"shard-{bucket.index:05d}.safetensors")
        req = DiskRequest(rel, tuple(TensorMeta.of_bucket(bucket)))
        n = bucket.completed
        # the engine reads the shard into memory before copying it into its parameters
        staged = Staged(ctx, bucket.payload_bytes)
        try:
            t0 = time.perf_counter()
            sent = [t0]

            def on_sent() -> None:
                sent[0] = time.perf_counter()
                ctx.record(bucket.index, "handoff", bucket.payload_bytes, n, sent[0] - t0)

            reply = await engine.transport_load(self.name, req.to_json(), on_sent=on_sent)
            ctx.record(bucket.index, "load", bucket.payload_bytes, reply.get("tensors", n),
                       time.perf_counter() - sent[0])
        finally:
            staged.free()

    async def _commit(self, ctx: SyncContext, buckets: list[Bucket]) -> None:
        tmp = self._tmp
        final = os.path.join(self.root, f"step-{ctx.weight_version}")
        manifest = {"format": FORMAT, "weight_version": ctx.weight_version, "step": ctx.step,
                    "tensors": sum(b.completed for b in buckets),
                    "bytes": sum(b.payload_bytes for b in buckets), "shards": self._shards}

        def commit() -> None:
            # The manifest last: its presence is what makes the directory complete.
            write_durable(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            if os.path.exists(final):  # a re-sync of the same version (after a recovery)
                _retire(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)

        with anyio.CancelScope(shield=True):  # a commit is not left half done
            await anyio.to_thread.run_sync(commit)
        self._tmp = None
        self.last_checkpoint = final
        for _, old in list_checkpoints(self.root)[:-self.keep]:
            _retire(old)

    def _cleanup(self) -> None:
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    async def aclose(self) -> None:
        if self._engine_ready is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                try:
                    await self._engine_ready.transport_close(self.name)
                except Exception:
                    pass
            self._engine_ready = None
        if self._finalizer is not None:
            self._finalizer()


class DiskReceiver:
    """Loads shards from under the root it was given, after checking path and contents."""

    def __init__(self, info: DiskInitInfo, device: Any = None):
        self.root = os.path.realpath(info.root)
        if not os.path.isdir(self.root):
            raise RequestError(f"checkpoint root {info.root!r} is not a directory")
        self.device = torch.device(device if device is not None else "cpu")

    def _path(self, rel: str) -> str:
        parts = rel.split("/")
        if len(parts) != 2 or not _TMP.match(parts[0]) or not _SHARD.match(parts[1]):
            raise RequestError(f"shard path {rel!r} is not of the form .tmp-<uuid>/shard-<n>.safetensors")
        path = os.path.join(self.root, *parts)
        if os.path.islink(path) or os.path.islink(os.path.dirname(path)) \
                or os.path.realpath(path) != path or not os.path.isfile(path):
            raise RequestError(f"shard {rel!r} is not a regular file under the checkpoint root {self.root}")
        return path

    @contextlib.contextmanager
    def receive(self, request: Any) -> Iterator[list[tuple[str, Any]]]:
        from safetensors.torch import load_file

        req = request if isinstance(request, DiskRequest) else DiskRequest.from_json(request)
        path = self._path(req.file)
        got = load_file(path, device=str(self.device))
        want = [m.name for m in req.tensors]
        if sorted(got) != sorted(want):
            raise RequestError(f"shard {req.file}: holds {sorted(got)}, the request lists {sorted(want)}")
        for m in req.tensors:
            t = got[m.name]
            shape = m.shape if m.whole else (m.nbytes // itemsize(m.dtype),)
            if tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != m.dtype \
                    or t.numel() * t.element_size() != m.nbytes:
                raise RequestError(f"shard {req.file}: {m.name} is {tuple(t.shape)} {t.dtype}, "
                                   f"the request says {shape} {m.dtype}")
        yield [(m.name, got[m.name] if m.whole else piece_of(m, got[m.name])) for m in req.tensors]

    def release(self, *, kept: bool = False) -> None:
        pass

    close = release


class DiskStrategy:
    name = "disk"
    request_type = DiskRequest
    init_info_type = DiskInitInfo

    def create_init_info(self, *, root: str) -> DiskInitInfo:
        return DiskInitInfo(os.path.realpath(root))

    def create_sender(self, **options: Any) -> DiskTransport:
        return DiskTransport(**options)

    def create_receiver(self, init_info: DiskInitInfo, *, device: Any = None) -> DiskReceiver:
        return DiskReceiver(init_info, device)


STRATEGY = DiskStrategy()
