"""Text: the tokenizer and the sandboxed chat template."""
