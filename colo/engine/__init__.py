"""The rollout engine: its own dense decoder (Qwen2, Qwen3, Llama; a Qwen3-MoE) with fused parameters
(``colo.engine.reference.model``) and the in-process state machine around it
(``colo.engine.reference.core``).

Nothing is imported here, so importing a sibling module that needs no torch
does not pull torch in through the package.
"""
