"""Tests of bench/: the research harnesses beside the package."""
