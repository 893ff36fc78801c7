"""Engines behind `jaxllm serve`: the contract (api) and the interim one-at-a-time engine (serial)."""
