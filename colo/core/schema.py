"""The ``colo.trace/1`` vocabulary: event names and bucket stages (pure data)."""

SCHEMA = "colo.trace/1"

#: Every event name the format defines; replay rejects any other.
EVENTS = frozenset({
    "trace.started", "phase.entered", "phase.finished", "phase.failed",
    "memory.paused", "memory.resumed", "bucket.finished", "sync.finished",
    "rollout.finished", "probe.finished", "trace.finished",
})
#: Stages of one bucket, in the order invariant 6 demands.
BUCKET_STAGES = ("upload", "gather", "pack", "handoff", "load")
