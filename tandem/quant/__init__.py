"""Quantization, one module per concern: the in-memory format and reference quantizers
(`weight`), how the model applies a quantized matrix (`linear`), quantizing as weights load
(`online`), quantized HF checkpoints (`checkpoint`: the format's config, the loader's reader
and the dispatch to one module per format: `awq`, `gptq`, `fp8`, `compressed_tensors`, with
AWQ's and GPTQ's shared int4 unpacking in `int4`), GGUF blocks (`gguf`) and the FP8 KV cache
(`kv`)."""
