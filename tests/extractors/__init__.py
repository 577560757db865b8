"""Tests of colo.extractors: plain, FSDP and Megatron extraction."""
