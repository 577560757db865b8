"""Validated, frozen configuration."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from colo.core.phases import PLANS, SYNC_TARGETS, Phase, parse_phase

from colo.core.units import MiB

#: when a sync's result is verified (the engine's digest, and the caller's check of it):
#: after every sync, after the first sync of the run only, or never
VERIFY = ("every", "first", "none")

#: the smallest sync bucket a user may ask for (``--bucket-mib``; about 10 KiB). Each bucket
#: is a round trip to the engine: at one byte a step of the 2.9 M-parameter demo ran past 180 s.
#: (SchedulerConfig itself takes any positive size: unit tests sync a few bytes.)
MIN_BUCKET_MIB = 0.01
#: the shortest phase deadline a user may ask for (``--phase-deadline``). The deadline ends a
#: hung phase; a phase's own work is a round trip to an engine or a rank at the least, and
#: on a busy host or a GPU a healthy phase takes a good part of a second (the CPU demo's
#: rollout on a 2-core VM: about 0.2 s), so a shorter one fails healthy runs without telling
#: a hang sooner: ``1e-300`` failed the first phase at once, after the whole start-up.
#: (SchedulerConfig itself takes any positive deadline: the fault tests hang phases for 0.5 s.)
MIN_PHASE_DEADLINE_S = 1.0
#: the smallest model ``colo tune --model-gib`` sizes for (about 1 MiB; the demo's is 5.5 MiB):
#: below it the recommended bucket, the model's size rounded up, fell to one byte
MIN_MODEL_GIB = 0.001


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    plan: str = "offload-first"
    bucket_bytes: int = 64 * MiB
    #: seconds a phase may take before it fails with a deadline error
    phase_deadline_s: float = 600.0
    #: per-phase overrides of ``phase_deadline_s``, by phase name
    deadlines: Mapping[str, float] = field(default_factory=dict)
    #: how long shielded cleanup may take after a failure or cancellation
    cleanup_deadline_s: float = 30.0
    #: ``every``, ``first`` or ``none`` (:data:`VERIFY`): which syncs compute the engine's
    #: digest and run the verifier; a digest is a pass over every engine weight, the
    #: largest fixed cost of a small model's sync
    verify: str = "every"
    #: what a sync moves (:data:`~colo.core.phases.SYNC_TARGETS`): the model's ``weights``, or a
    #: LoRA ``adapter`` beside base weights the engine keeps through the cycle
    sync_target: str = "weights"

    def __post_init__(self) -> None:
        if self.sync_target not in SYNC_TARGETS:
            raise ValueError(f"sync_target must be one of {', '.join(SYNC_TARGETS)}, got {self.sync_target!r}")
        if self.plan not in PLANS:
            raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {self.plan!r}")
        if self.verify not in VERIFY:
            raise ValueError(f"verify must be one of {', '.join(VERIFY)}, got {self.verify!r}")
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive integer, got {self.bucket_bytes!r}")
        for name, value in (("phase_deadline_s", self.phase_deadline_s),
                            ("cleanup_deadline_s", self.cleanup_deadline_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        clean = {}
        for name, value in dict(self.deadlines).items():
            phase = parse_phase(name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"deadline for {name} must be > 0 seconds, got {value!r}")
            clean[phase.value] = float(value)
        object.__setattr__(self, "deadlines", MappingProxyType(clean))

    def deadline(self, phase: Phase) -> float:
        return self.deadlines.get(phase.value, self.phase_deadline_s)

    def as_dict(self) -> dict:
        return {"plan": self.plan, "bucket_bytes": self.bucket_bytes,
                "phase_deadline_s": self.phase_deadline_s, "deadlines": dict(self.deadlines),
                "cleanup_deadline_s": self.cleanup_deadline_s, "verify": self.verify,
                **({"sync_target": self.sync_target} if self.sync_target != "weights" else {})}
