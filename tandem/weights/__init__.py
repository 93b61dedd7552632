"""Weights: finding and fetching a model (`fetch`), reading safetensors (`safetensors_io`) and
GGUF files (`gguf`), assembling the model from them (`loader`), and the tiny-model generator
(`tiny`)."""
