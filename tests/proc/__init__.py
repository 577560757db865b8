"""Tests of colo.proc: the channel, the engine process's lifecycle, the start-up sweep."""
