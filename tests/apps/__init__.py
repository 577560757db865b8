"""Tests of colo.apps: the demo and bench as a user runs them (outputs, bad input, interrupts, soak)."""
