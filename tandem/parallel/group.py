"""The collectives a tensor-parallel forward needs, over one torch.distributed group.

Backend: gloo on a CPU, NCCL on CUDA (`backend_for`). On a CPU the forward's collectives go
through shared memory instead where they fit (`tandem.parallel.shm`: tens of
microseconds a call where gloo's loopback TCP takes 0.5-1 ms); `shared_memory=False`
(`EngineConfig.tp_shared_memory`) keeps them on gloo. A model of one rank has no group at
all (`LlamaModel(tp=None)`): the single-device path runs no collective and pays nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.parallel import shm as shm_exchange
from tandem.parallel.sharding import Shard

log = logging.getLogger(__name__)

# A collective waiting longer than this means a rank is gone (a rank that dies ends the
# worker first: tandem.engine.ranks); idle ranks wait on their step pipe, not in a collective.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def backend_for(device: str) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class TPGroup:
    """This process's place in a tensor-parallel group, and the group's collectives.

    `init` joins the group (every rank calls it with the same address); the collectives
    are then called by every rank in the same order (the forward is the same program on
    every rank).
    """

    def __init__(self, shard: Shard, shm: shm_exchange.ShmExchange | None = None) -> None:
        self.shard = shard
        self.shm = shm  # the forward's collectives through shared memory (a CPU's ranks)

    @classmethod
    def init(cls, shard: Shard, address: str, device: str, shared_memory: bool = True) -> TPGroup:
        """Join the group rendezvousing at `address` ("host:port", rank 0 listens there);
        `shared_memory`: a CPU group's forward collectives through /dev/shm where safe."""
        backend = backend_for(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=shard.rank,
            world_size=shard.size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        shm = None
        if backend == "gloo" and shared_memory and shm_exchange.available():
            try:
                shm = shm_exchange.ShmExchange.create(shard.rank, shard.size)
            except OSError as exc:  # every rank: rank 0's failure is broadcast
                log.warning("tensor-parallel collectives stay on gloo: %s", exc)
        return cls(shard, shm)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def _shm_parts(
        self, x: torch.Tensor, shapes: Sequence[tuple[int, ...]]
    ) -> list[torch.Tensor] | None:
        """Every rank's `x` through shared memory, or None where the group has none or the
        largest part does not fit (the same answer on every rank: it depends on shapes)."""
        if self.shm is None:
            return None
        largest = max(math.prod(s) for s in shapes) * x.element_size()
        return self.shm.gather(x, shapes) if self.shm.fits(largest) else None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (through shared memory: added in rank order,
        the same bits on every rank)."""
        parts = self._shm_parts(x, [tuple(x.shape)] * self.size)
        if parts is None:
            dist.all_reduce(x)
            return x
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of `x` over the ranks, in place."""
        parts = self._shm_parts(x, [tuple(x.shape)] * self.size)
        if parts is None:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            return x
        x.copy_(parts[0])
        for part in parts[1:]:
            torch.maximum(x, part, out=x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, size * n], rank 0's columns first."""
        parts = self._shm_parts(x, [tuple(x.shape)] * self.size)
        if parts is None:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def all_gather_columns(self, x: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
        """[rows, widths[rank]] on every rank -> [rows, sum(widths)], rank 0's columns
        first. Over gloo uneven widths travel padded to the widest (it gathers equal
        shapes)."""
        parts = self._shm_parts(x, [(*x.shape[:-1], w) for w in widths])
        if parts is not None:
            return torch.cat(parts, dim=-1)
        widest = max(widths)
        x = x.contiguous()
        if x.shape[-1] < widest:
            x = torch.nn.functional.pad(x, (0, widest - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        if widest == min(widths):
            return torch.cat(parts, dim=-1)
        return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)

    def gather_ints(self, values: list[int], device: str) -> list[list[int]]:
        """Every rank's `values` (the same count on each), by rank."""
        t = torch.tensor(values, dtype=torch.int64, device=device)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t)
        return [p.tolist() for p in parts]

    def min_int(self, value: int, device: str) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's device can
        hold: the group serves with the least)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()
