"""The model: a Llama-family decoder (`llama`) with its config, attention backends, RoPE,
matmuls and MoE layers. Loading it is `tandem.weights`, quantized matrices `tandem.quant`,
tokenizers `tandem.tokenizer`, tensor parallelism `tandem.parallel`."""
