"""KV cache tiers behind a worker's device prefix cache: host memory, then local disk."""
