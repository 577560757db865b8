"""Tests of colo.device: CUDA memory, flat weights and the one-copy sync."""
