"""The ``colo.trace/1`` vocabulary: event names and bucket stages (pure data)."""

SCHEMA = "colo.trace/1"

#: Every event name the format defines; replay rejects any other.
EVENTS = frozenset({
    "trace.started", "phase.entered", "phase.finished", "phase.failed",
    "memory.paused", "memory.resumed", "bucket.finished", "sync.finished",
    "rollout.finished", "probe.finished", "trace.finished",
    # a sync-first sync's digests checked once the trainer's offload took its own
    "digest.checked",
    # an engine's own sub-states (colo.core.phases.SUBSTATES): its weight-update session
    # and its paused generation, written only for engines whose capabilities declare them
    "session.opened", "session.closed", "generation.paused", "generation.continued",
    # an adapter sync's stage: opened before its first byte, closed once every rank's
    # digest checked and the new version serves
    "adapter.staging", "adapter.activated",
})
#: ``trace.started`` carries ``run_id``: one id for every rank's trace of one run, new for each
#: run (a second run with the same seed and config is another run). Replay and tune take
#: several files as one run only if they share it; a trace written before it existed has
#: none and still replays. At most this many characters, printable ASCII.
RUN_ID_MAX = 128
#: Stages of one bucket, in the order invariant 6 demands.
BUCKET_STAGES = ("upload", "gather", "pack", "handoff", "load")
