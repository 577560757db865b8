"""Tests of colo.engine: the model, EngineCore, tensor parallelism, MoE, the engine process."""
