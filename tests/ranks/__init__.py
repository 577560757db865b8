"""Tests of colo.ranks: many ranks under Ray."""
