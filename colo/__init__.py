"""colo: the colocated trainer/engine GPU handoff as an explicit, traced state machine.

Import what you need from its modules; this package imports nothing heavy so
that the pure core (phases, invariants, buckets, memory ledger) stays pure.
"""

__version__ = "0.1.0"
