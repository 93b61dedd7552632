"""Text: the tokenizer with its chat templates (`tokenizer`), streaming detokenization
(`detokenize`) and a GGUF file's vocabulary as a tokenizer.json (`gguf`)."""
