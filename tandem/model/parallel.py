"""The collectives a tensor-parallel forward needs, over one torch.distributed group.

Backend: gloo on a CPU, NCCL on CUDA (`backend_for`). A model of one rank has no group at
all (`LlamaModel(tp=None)`): the single-device path runs no collective and pays nothing.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.model.sharding import Shard

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

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    @classmethod
    def init(cls, shard: Shard, address: str, device: str) -> TPGroup:
        """Join the group rendezvousing at `address` ("host:port", rank 0 listens there)."""
        dist.init_process_group(
            backend_for(device),
            init_method=f"tcp://{address}",
            rank=shard.rank,
            world_size=shard.size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        return cls(shard)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of `x` over the ranks, in place."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, size * n], rank 0's columns first."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def all_gather_columns(self, x: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
        """[rows, widths[rank]] on every rank -> [rows, sum(widths)], rank 0's columns
        first. Uneven widths travel padded to the widest (gloo gathers equal shapes)."""
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
        if dist.is_initialized():
            dist.destroy_process_group()
