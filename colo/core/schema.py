"""The ``colo.trace/1`` vocabulary: event names and bucket stages (pure data)."""

SCHEMA = "colo.trace/1"

#: Every event name the format defines; replay rejects any other.
EVENTS = frozenset({
    "trace.started", "phase.entered", "phase.finished", "phase.failed",
    "memory.paused", "memory.resumed", "bucket.finished", "sync.finished",
    "rollout.finished", "probe.finished", "trace.finished",
    # an engine's own sub-states (colo.core.phases.SUBSTATES): its weight-update session
    # and its paused generation, written only for engines whose capabilities declare them
    "session.opened", "session.closed", "generation.paused", "generation.continued",
})
#: Stages of one bucket, in the order invariant 6 demands.
BUCKET_STAGES = ("upload", "gather", "pack", "handoff", "load")
