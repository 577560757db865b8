"""Every refusal colo raises, under one base, with the exit code each maps to.

A caller that embeds colo catches :class:`ColoError` and reads ``exit_code``:
0 success, 1 a failed check or run, 2 bad input or usage. The command line
maps exceptions to exit codes through this module and nothing else; no module
imports the command line.

Each class keeps the builtin base it had before (``ValueError``,
``RuntimeError``, ``MemoryError``, ``KeyError``) so that code written against
those still catches it. Pure: no torch, anyio or structlog.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from colo.core.units import fmt_bytes

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class ColoError(Exception):
    """The base of every error colo raises on purpose."""

    exit_code = EXIT_FAILED


class BadInput(ColoError):
    """Input that is wrong before any work starts: exit 2."""

    exit_code = EXIT_BAD_INPUT


# -- bad input (exit 2, except where a class says otherwise) ----------------------------

class UsageError(BadInput, ValueError):
    """A flag or argument that is wrong: reported on one line, exit 2."""


class BadTrace(BadInput, ValueError):
    """Input that cannot be read as ``colo.trace/1`` (exit 2)."""


class TuneError(BadInput, ValueError):
    """Bad input to the tuner (exit 2)."""


class RequestError(ColoError, ValueError):
    """A request or init info that does not have the fields its transport expects."""


class HandleError(ColoError, ValueError):
    """A handle that is malformed or of a kind that is not allowed."""


class SharedMemoryFull(ColoError, MemoryError):
    """``/dev/shm`` (a tmpfs) has no room for a segment colo needs: never a SIGBUS at the
    first touch of a page that was not there. Said before the run's start-up where the need
    is known (``before_start``: bad input, exit 2), else as the phase that asked for it
    failing (exit 1)."""

    #: what frees room or needs less, as the command line says it
    MORE = ("give this machine or container more shared memory (a container's /dev/shm is 64 MiB unless "
            "started with e.g. docker run --shm-size=2g)")
    REMEDY = "use a smaller --bucket-mib, or " + MORE

    def __init__(self, *, where: str, what: str, need: int, room: int, before_start: bool = False,
                 remedy: str = REMEDY):
        self.where, self.what, self.need, self.room = where, what, need, room
        if before_start:
            self.exit_code = EXIT_BAD_INPUT
        super().__init__(f"{where} has {fmt_bytes(room)} free, and {fmt_bytes(need)} is needed for {what}: {remedy}")


class FaultMissed(ColoError):
    """An injected fault (``colo demo --fault``) that failed no phase: every step ran, so the run
    proved nothing about recovery from it (exit 1). ``steps``: the steps that ran."""

    def __init__(self, message: str, *, steps: int):
        super().__init__(message)
        self.steps = steps


class IncompleteCheckpoint(ColoError, ValueError):
    """A directory that is not a complete, committed checkpoint."""


class UnknownTensor(ColoError, KeyError):
    """A name the extractor does not have; printed as a sentence, not a quoted key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class WeightMismatch(ColoError, ValueError):
    """Incoming weights do not match what the engine expects.

    Raised once per check with every problem found, never one at a time: a
    sync that is wrong in ten places should say so in one message.
    """

    def __init__(self, context: str, *, missing: Sequence[str] = (), unexpected: Sequence[str] = (),
                 duplicate: Sequence[str] = (), wrong_shape: Sequence[str] = (),
                 wrong_dtype: Sequence[str] = ()) -> None:
        self.missing, self.unexpected, self.duplicate = tuple(missing), tuple(unexpected), tuple(duplicate)
        self.wrong_shape, self.wrong_dtype = tuple(wrong_shape), tuple(wrong_dtype)
        lines = [f"{context}:"]
        for label, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("duplicate", self.duplicate), ("wrong shape", self.wrong_shape),
                             ("wrong dtype", self.wrong_dtype)):
            if items:
                lines.append(f"  {label} ({len(items)}): " + ", ".join(items))
        super().__init__("\n".join(lines))

    @property
    def empty(self) -> bool:
        return not (self.missing or self.unexpected or self.duplicate or self.wrong_shape or self.wrong_dtype)


class KVPoolTooSmall(BadInput, ValueError):
    """``mem_fraction_static`` leaves too little room for the KV pool."""


class UnsupportedArchitecture(BadInput, ValueError):
    """A model config whose ``model_type`` is not in colo's architecture table
    (:mod:`colo.models.arch`), or that asks for a feature of it colo does not implement
    (an attention bias on Llama, a sliding window): the message names the model_type,
    the feature, and what is supported."""


class CheckpointError(BadInput, ValueError):
    """A checkpoint directory colo cannot load: missing, not a Hugging Face checkpoint (no
    ``config.json``), or whose tensors are not the ones its config's architecture has."""


class EngineRefused(BadInput, ValueError):
    """The engine refused the build it was sent (a malformed model config, a dtype or device it
    does not have, more memory than the device or the machine holds), before building anything."""


# -- refusals and failures (exit 1) ---------------------------------------------------

class IllegalTransition(ColoError, ValueError):
    """A transition the table does not allow; the machine did not move."""

    def __init__(self, current: Any, trigger: str, target: Any, allowed: Iterable[str] = ()):
        self.current, self.trigger, self.target = current, trigger, target
        here = current or "start"
        super().__init__(
            f"illegal transition from phase {here!s} on trigger {trigger!r} to {target or '?'!s}; "
            f"allowed triggers from {here!s}: {', '.join(sorted(allowed)) or 'none'}")


class InvariantViolation(ColoError, RuntimeError):
    """A step the scheduler refused because it would break an invariant."""

    def __init__(self, violations: list[Any]):
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations))


class OutOfMemory(ColoError, MemoryError):
    """An allocation or resume that would exceed the device budget."""

    def __init__(self, *, phase: str | None, tag: str, requested: int, free: int, total: int,
                 in_use: dict[str, int], rank: int | None = None):
        self.phase, self.tag, self.requested, self.free, self.total = phase, tag, requested, free, total
        self.in_use, self.rank = dict(in_use), rank
        held = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in in_use.items() if v) or "nothing"
        where = f" on rank {rank}" if rank is not None else ""
        super().__init__(
            f"out of memory in phase {phase or '-'}{where}: {tag} asks {fmt_bytes(requested, True)}, "
            f"{fmt_bytes(free, True)} free of {fmt_bytes(total)}; in use: {held}")


class TagStateError(ColoError, RuntimeError):
    """Pausing a paused tag or resuming a resident one."""


# -- a side failing (exit 1) -------------------------------------------------------

class EngineStateError(ColoError, RuntimeError):
    """An operation the engine's current state does not allow (released tag, stale weights)."""


class EngineError(ColoError, RuntimeError):
    """The engine process answered an operation with an error."""

    def __init__(self, op: str, error_type: str, message: str):
        self.op, self.error_type = op, error_type
        super().__init__(f"engine {op} failed: {error_type}: {message}")


class EngineDied(ColoError, RuntimeError):
    """The engine process is gone."""


class PhaseDeadline(ColoError, TimeoutError):
    """A phase ran past its deadline (``SchedulerConfig.deadline``); the message names both."""


class ClusterUnreachable(ColoError, ConnectionError):
    """The cluster a run was told to join (``--address``) did not answer in time."""


class ChannelError(ColoError, RuntimeError):
    """The peer broke the protocol (bad frame, bad auth, closed)."""


class VerificationError(ColoError, RuntimeError):
    """The engine's weights after a sync are not the trainer's."""


class RankFailed(ColoError, RuntimeError):
    """One rank of a group failed a verb; the other ranks' outcomes are kept."""

    def __init__(self, side: str, verb: str, rank: int, cause: BaseException, outcomes: dict[int, str]):
        self.side, self.verb, self.rank, self.cause, self.outcomes = side, verb, rank, cause, dict(outcomes)
        # the run ends for the cause's reason: a build every engine rank refused is bad input (2)
        self.exit_code = exit_code(cause)
        super().__init__(f"{side} rank {rank} failed {verb}: {type(cause).__name__}: {cause}")


class RankError(ColoError, RuntimeError):
    """A rank's worker process answered a verb with an error colo has no class for."""

    def __init__(self, rank: int, op: str, error_type: str, message: str):
        self.rank, self.op, self.error_type = rank, op, error_type
        super().__init__(f"rank {rank} {op} failed: {error_type}: {message}")


class RankDied(ColoError, RuntimeError):
    """A rank's worker process is gone (and its trainer rank and engine rank with it)."""


class TraceUnwritable(ColoError, OSError):
    """The trace file could not be written (a full disk, a quota): the run stops, exit 1.

    ``errno`` is the operating system's; ``step`` and ``phase`` say where the run was
    (None before it started)."""

    def __init__(self, message: str, *, errno: int | None = None, step: int | None = None,
                 phase: str | None = None) -> None:
        super().__init__(message)
        self.errno, self.step, self.phase = errno, step, phase

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InjectedFault(ColoError, RuntimeError):
    """The error a ``raise`` fault raises (colo.testing.faults)."""


def exit_code(exc: BaseException) -> int:
    """The exit code an exception maps to: its own, or 1 for anything unplanned."""
    return getattr(exc, "exit_code", EXIT_FAILED) if isinstance(exc, ColoError) else EXIT_FAILED


__all__ = ["BadInput", "BadTrace", "ChannelError", "ClusterUnreachable", "ColoError", "EXIT_BAD_INPUT",
           "EXIT_FAILED", "EXIT_OK", "EngineDied", "EngineError", "EngineRefused", "EngineStateError", "HandleError", "IllegalTransition",
           "SharedMemoryFull", "IncompleteCheckpoint",
           "InjectedFault", "InvariantViolation", "KVPoolTooSmall", "OutOfMemory", "PhaseDeadline", "RankDied", "RankError", "RankFailed", "RequestError",
           "TagStateError", "TraceUnwritable", "TuneError", "UnknownTensor", "UsageError", "VerificationError", "WeightMismatch",
           "exit_code"]
