"""Pure XLA forms of a transformer block, as array functions: dense (norm, rope, attention, mlp,
projections, the embedding lookup), moe (routing and the expert paths), quant (the int8 leaf)."""
