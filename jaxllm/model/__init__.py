"""The model: its config, the parameter table, the KV cache, the pure transformer step, and the
mesh layout (sharding)."""
