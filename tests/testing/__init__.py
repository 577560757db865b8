"""Tests of colo.testing: fault injection through real runs."""
