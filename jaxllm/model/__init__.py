"""The model: its config, the parameter table, the KV cache, the step plan (which kernels a step
takes), the pure transformer step, and the mesh layout (sharding)."""
