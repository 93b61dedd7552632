"""Tensor parallelism: the rank group and its collectives (`group`), how a model splits across
ranks (`sharding`) and the CPU's shared-memory collectives (`shm`)."""
