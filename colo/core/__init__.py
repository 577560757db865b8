"""The pure core: phases and their effects, invariants, the memory ledger, bucket
planning, configuration and the trace vocabulary.

Nothing in this package imports torch, anyio or structlog (a test imports every
module here and fails if one does): the scheduler uses it live, and replay and
tuning reuse it offline.
"""
