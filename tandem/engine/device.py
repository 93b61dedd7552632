"""The engine's CUDA device as the current device of every thread that drives it.

Tensors carry their device, but Triton launches its kernels on the thread's current CUDA
device, and `torch.cuda.graph` captures there too. The current device is per host thread
and starts at 0, so an engine on `cuda:1` must make it current in each thread that steps it
(the engine thread) or moves its KV (a transfer thread), not only where it was built.
"""

from __future__ import annotations

import torch


def use_device(device: str | torch.device) -> None:
    """Make `device` the calling thread's current CUDA device; nothing for other devices
    (and for a bare "cuda", which means the current one)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev.index)
