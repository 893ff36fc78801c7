"""Text: the tokenizer, the sandboxed chat template, incremental detokenization and stop strings."""
