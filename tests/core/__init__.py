"""Tests of colo.core: phases, invariants, memory, buckets."""
