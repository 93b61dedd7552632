"""The KV cache tensor and its layout.

    kv_cache: [num_blocks, slots, 2 (K, V), block_size, num_kv_heads, head_dim]

Each block holds `slots` layers' K and V (`ModelConfig.kv_layout`): a model whose attention
layers all keep every token has one table and a slot per layer, in layer order (a
linear-attention layer keeps its per-request state outside the pages); one with sliding
layers splits them from the full ones into tables of `slots` layers, each block belonging
to one table (tandem.model.layer_groups.KVLayout).

One block holds every layer's K and V contiguously, so moving a block to another worker is
one descriptor, and a run of adjacent block ids is one contiguous byte range. A layer's
view `kv_cache[:, i]` (i: its index among the kv layers) is strided across blocks, which the
attention backend handles.
"""

from __future__ import annotations

import errno
import os
import tempfile

import torch

from tandem.model.config import ModelConfig


def block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers."""
    return block_size * model.kv_elements_per_token * dtype.itemsize


def allocate_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Zeroed cache tensor (zeros so that a never-written slot is not NaN garbage)."""
    shape = (num_blocks, model.kv_layout.slots, 2, block_size, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def shared_kv_path(prefix: str, rank: int) -> str:
    """The file rank `rank`'s cache lives in when a tensor-parallel worker's ranks share
    theirs with rank 0 (`allocate_shared_kv_cache`)."""
    return f"{prefix}.rank{rank}"


def map_kv_file(
    path: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool
) -> torch.Tensor:
    """A CPU tensor of `shape` on a file mapped shared (`create`: the file is made, zeroed,
    by this call). Every process that maps the file sees the same bytes: a tensor-parallel
    worker's rank 0 maps its ranks' caches so that its transport reads and writes each
    rank's heads (tandem.transfer, `RemoteKV.ranks`)."""
    import mmap

    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            _allocate(fd, nbytes, path)
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {nbytes}")
        buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the file
    # frombuffer keeps `buf` alive as long as the tensor.
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def shared_kv_dir() -> str:
    """Where shared caches' files are made: /dev/shm (memory) when there is one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _allocate(fd: int, nbytes: int, path: str) -> None:
    """Zeroed pages for the whole file now: a tmpfs too small for the cache fails here, with
    a reason, instead of with SIGBUS when a step first writes past its room."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ValueError(
                f"no room for a {nbytes / 2**20:.0f} MiB KV cache in {os.path.dirname(path)} "
                "(a tensor-parallel worker's ranks share their caches there): enlarge it "
                "(a container's /dev/shm) or lower the KV cache size"
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # no fallocate here: a hole, zeros on first touch
