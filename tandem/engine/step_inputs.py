"""The host side of a step's inputs: block tables that persist on the device, and one copy
of the step's small arrays.

A decode step's inputs are tiny (a few ints per row), but each pageable host->device copy
waits for the stream, and rebuilding every row's padded block table from Python costs more
than the step's kernels at large batch. So:

- `BlockTables` keeps each live request's table in one row of a device tensor and writes
  only the entries that changed since the request's last step (a decode step usually
  changes none; crossing into a new block changes one):

      table (device, int32)      row_of: {"a": 0, "b": 1}
      row 0: [ 7  2  9 .. ..]    "a" holds blocks (7, 2, 9); entries past them are stale,
      row 1: [ 4 .. .. .. ..]    and never read (each kernel stops at the context length)

- `HostStaging` packs the step's arrays into one host buffer (pinned on CUDA) and sends it
  with one non-blocking copy; the arrays come back as views of one device tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

# Rows a new table starts with; it doubles when more requests are live at once.
_INITIAL_ROWS = 64


class BlockTables:
    """Every live request's block table as one row of a persistent device tensor.

    `row(request_id, block_ids)` names the request's row and queues the writes that bring
    it to `block_ids`: the appended entries, or the whole table when it changed otherwise
    (a preempted request resumed on new blocks). `take_writes()` hands the queued writes to
    the step, which applies them on the device (`apply`). `release` frees a finished
    request's row for reuse.

    Args:
        max_blocks: row width, the blocks of the longest context.
        device: where the table lives.
    """

    def __init__(self, max_blocks: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self.table = torch.zeros((_INITIAL_ROWS, max_blocks), dtype=torch.int32, device=device)
        self._rows: dict[str, int] = {}  # request id -> its row
        self._written: dict[str, tuple[int, ...]] = {}  # request id -> what its row holds
        self._free = list(range(_INITIAL_ROWS - 1, -1, -1))  # pop() hands out row 0 first
        self._writes: tuple[list[int], list[int], list[int]] = ([], [], [])  # rows, cols, ids

    def row(self, request_id: str, block_ids: tuple[int, ...]) -> int:
        """The request's row (assigned on first sight), its pending writes queued."""
        assert len(block_ids) <= self.max_blocks, f"{len(block_ids)} > {self.max_blocks} blocks"
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = self._take_row()
        written = self._written.get(request_id, ())
        keep = len(written) if block_ids[: len(written)] == written else 0
        if keep < len(block_ids):
            rows, cols, ids = self._writes
            rows += [row] * (len(block_ids) - keep)
            cols += range(keep, len(block_ids))
            ids += block_ids[keep:]
        self._written[request_id] = block_ids
        return row

    def release(self, request_id: str) -> None:
        """Free the request's row (nothing if it never had one)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._written.pop(request_id)
            self._free.append(row)

    def request_ids(self) -> set[str]:
        """The requests holding a row."""
        return set(self._rows)

    def take_writes(self) -> tuple[list[int], list[int], list[int]]:
        """(rows, columns, block ids) of the entries queued since the last call."""
        writes, self._writes = self._writes, ([], [], [])
        return writes

    def apply(self, rows: torch.Tensor, cols: torch.Tensor, block_ids: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = block_ids[i] on the device (the taken writes, staged)."""
        if rows.numel():
            self.table[rows, cols] = block_ids.to(torch.int32)

    def _take_row(self) -> int:
        if not self._free:
            n = self.table.shape[0]
            dev = self.table.device
            grown = torch.zeros((2 * n, self.max_blocks), dtype=torch.int32, device=dev)
            grown[:n] = self.table
            self.table = grown
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()


class HostStaging:
    """A step's small integer arrays sent to the device in one copy.

    On CUDA they are packed into one pinned host buffer and sent with one non-blocking copy
    (a pageable copy waits for the stream); the buffer is refilled only once the previous
    copy has read it (an event). Elsewhere the packed tensor is already on the device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # pinned, CUDA only
        self._device_buf: torch.Tensor | None = None
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def send(self, arrays: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The arrays as int64 tensors on the device: views of one buffer, valid until the
        next call (a step uses them, then the next step's arrays replace them)."""
        sizes = [len(a) for a in arrays]
        flat = list(itertools.chain.from_iterable(arrays))
        packed = torch.tensor(flat, dtype=torch.int64, device="cpu")
        if self._copied is not None:
            packed = self._to_device(packed)
        return list(packed.split(sizes))

    def _to_device(self, packed: torch.Tensor) -> torch.Tensor:
        assert self._copied is not None
        n = packed.numel()
        if self._host is None or self._device_buf is None or self._host.numel() < n:
            i64 = torch.int64
            size = max(n, 2 * (0 if self._host is None else self._host.numel()), 1024)
            self._host = torch.empty(size, dtype=i64, pin_memory=True)  # device: cpu-only (pinned)
            self._device_buf = torch.empty(size, dtype=i64, device=self.device)
        else:
            self._copied.synchronize()  # the last copy has read the buffer
        host, dev = self._host[:n], self._device_buf[:n]
        host.copy_(packed)
        dev.copy_(host, non_blocking=True)
        self._copied.record()
        return dev
