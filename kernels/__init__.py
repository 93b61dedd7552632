"""Attention kernels: a pure-torch reference now; Triton kernels for CUDA plug in here."""
