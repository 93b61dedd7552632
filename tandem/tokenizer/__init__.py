"""Text: the tokenizer, with chat encoding that keeps client text out of control tokens
(`tokenizer`), chat-template rendering (`templates`), streaming detokenization (`detokenize`)
and a GGUF file's vocabulary as a tokenizer.json (`gguf`)."""
