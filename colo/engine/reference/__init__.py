"""colo's own engine, the reference adapter: a dense decoder (Qwen2, Qwen3, Llama; a Qwen3-MoE)
with fused parameters (``model.py``), the in-process state machine around it (``core.py``),
tensor parallelism (``tp.py``, ``moe.py``), its process and its client (``server.py``,
``client.py``), and how the demo, the benchmark and a rank start it (``start.py``, the
registry's ``colo`` entry: :data:`colo.engine.ENGINES`).

Nothing is imported here, so importing a sibling module that needs no torch
does not pull torch in through the package.
"""
