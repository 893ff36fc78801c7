"""Reading and writing models: HF safetensors, GGUF, the parameter reading threads, orbax
checkpoints, `load` (the one path dispatch), paths and the compilation cache."""
