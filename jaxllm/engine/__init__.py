"""Running a model: sampling, the memory check, the checked steps, compile accounting, generate
and stream, and scoring (perplexity)."""
