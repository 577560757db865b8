"""The rollout engine: its own Qwen2 implementation with fused parameters
(``colo.engine.model``) and the in-process state machine around it
(``colo.engine.core``).

Nothing is imported here, so importing a sibling module that needs no torch
does not pull torch in through the package.
"""
