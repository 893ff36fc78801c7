"""Text around token ids: incremental detokenization and stop strings (detokenize)."""
