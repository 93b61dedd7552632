"""Quantization, one module per concern: the in-memory format and reference quantizers
(`weight`), how the model applies a quantized matrix (`linear`), quantizing as weights load
(`online`), quantized checkpoints (`checkpoint`: AWQ, GPTQ, FP8, compressed-tensors), GGUF
blocks (`gguf`) and the FP8 KV cache (`kv`)."""
