"""Running a model: sampling, the memory check, the checked steps, compile accounting, generate
and stream, scoring (perplexity), and the engines behind `jaxllm serve` (the contract in api).
"""
