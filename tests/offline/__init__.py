"""Tests of colo.offline: replay, export, tune (and the notebook that reads traces)."""
