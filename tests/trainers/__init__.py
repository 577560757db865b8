"""Tests of colo.trainers: the demo trainers, alone and as ranks."""
