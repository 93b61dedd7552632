"""CUDA graphs for decode-only steps: which batch sizes to capture, and the static buffers.

A decode step launches a few hundred small kernels whose work is tiny at small batch sizes,
so on a GPU the CPU's launch overhead, not the GPU, sets the step time. A CUDA graph records
the launches once and replays them with one call. A graph replays fixed addresses and fixed
shapes, so every input lives in a static buffer that the runner overwrites before each
replay, and a batch of n rows runs the graph captured for the smallest size >= n, its extra
rows padded to a harmless state (see `DecodeBuffers`).

How the runner is expected to use it (on CUDA, with an attention backend whose launch grids
depend only on tensor shapes, never on values such as context lengths):

    # startup (LLMEngine.warm_up), after the KV cache exists:
    sizes = capture_sizes(max_num_seqs)
    buffers = DecodeBuffers(sizes[-1], max_blocks=ceil(max_model_len / block_size),
                            padding_block_id=<a block reserved from the pool>, device=dev)
    graphs = DecodeGraphs(buffers, sizes)
    graphs.capture(lambda inputs: model.forward(<ids, positions, metadata built from inputs>))

    # each step:
    if step is decode-only and graphs.can_serve(n):
        hidden = graphs.replay(n, ids, positions, slot_block_ids, slot_offsets, tables, lens)
    else:
        hidden = <eager forward, as today>   # prefill tokens, or more rows than captured

With tensor parallelism every rank captures and replays in lockstep: the graphs hold the
forward's NCCL collectives, and a captured collective is one of the whole group, so every
rank captures the same sizes in the same order (`CapturePlan`, derived alike on every rank)
and every step replays the same size on every rank or runs eagerly on every rank (rank 0
decides and sends the decision with the step: tandem.engine.runner, tandem.engine.ranks).

`capture_sizes`, `graph_size_for`, `CapturePlan` and `DecodeBuffers` are pure (tensors on the
caller's device, no CUDA calls) and unit-tested on CPU; only `DecodeGraphs` touches
`torch.cuda`, in three methods (`_warm_up`, `_record`, `_launch`) that a CPU stand-in can
replace to run the rest of it (tests/unit/test_tensor_parallel_graphs.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

# Capture grid: 1, 2, 4, then every 8 rows up to 64, then every 16 rows up to 256.
# - Padding is cheap: a decode step is memory-bound (every step reads all the weights), so
#   extra GEMM rows cost almost nothing, and a padding row attends over one token. The grid
#   bounds the padding at 7 rows up to 64 and 15 rows above.
# - Each size costs capture time at startup (a warm-up run plus a capture) and its own output
#   tensor; 23 graphs at most keep startup to seconds. Small batches, the common case at low
#   load and where launch overhead dominates most, get the finest grid.
# - Capped at 256: beyond that a step's GEMMs and attention take milliseconds, the launch
#   overhead a graph removes is a small fraction of it, and such steps run eagerly.
MAX_CAPTURE_SIZE = 256
_CAPTURE_GRID = (1, 2, 4, *range(8, 65, 8), *range(80, MAX_CAPTURE_SIZE + 1, 16))


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded batch sizes to capture graphs for: sorted, unique, ending at
    `min(max_num_seqs, MAX_CAPTURE_SIZE)` (so the scheduler's largest decode batch replays
    whenever the cap allows)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return tuple(sorted({s for s in _CAPTURE_GRID if s <= top} | {top}))


def graph_size_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest size in `sizes` (sorted ascending) that holds `batch` rows, or None when
    `batch` is larger than all of them (the step runs eagerly)."""
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def capture_order(sizes: Sequence[int]) -> tuple[int, ...]:
    """The order `DecodeGraphs.capture` captures `sizes` in: largest first (the smaller
    graphs reuse the memory pool the larger ones freed)."""
    return tuple(sorted(sizes, reverse=True))


class CapturePlan(NamedTuple):
    """What a rank captures: graphs of `sizes` (ascending; captured in `capture_order`) over
    buffers `max_blocks` wide whose padding rows use `padding_block_id`. Every rank of a
    tensor-parallel worker derives it from the same inputs and must get the same plan: the
    graphs' collectives pair up across ranks only when every rank captures the same shapes
    in the same order, and rank 0's block tables (the padding block included) are every
    rank's."""

    sizes: tuple[int, ...]
    max_blocks: int
    padding_block_id: int

    @property
    def order(self) -> tuple[int, ...]:
        return capture_order(self.sizes)


def capture_plan(
    max_num_seqs: int, max_model_len: int, block_size: int, padding_block_id: int
) -> CapturePlan:
    """The graphs a rank captures: `capture_sizes(max_num_seqs)` over block tables wide
    enough for `max_model_len` tokens. Pure: the same arguments give every rank the same
    plan."""
    if max_model_len < 1 or block_size < 1:
        raise ValueError(
            f"max_model_len and block_size must be positive, got {max_model_len}, {block_size}"
        )
    max_blocks = -(-max_model_len // block_size)
    return CapturePlan(capture_sizes(max_num_seqs), max_blocks, padding_block_id)


def check_capture_plan(sent: CapturePlan, own: CapturePlan) -> None:
    """A follower rank's check of rank 0's plan against the one it derived itself.

    Raises:
        ValueError: they differ (capturing either would pair different collectives across
            the ranks: a hang or wrong sums on the first replay).
    """
    if sent != own:
        raise ValueError(
            f"rank 0 captures decode graphs as {sent}, this rank derives {own}: the ranks' "
            "configs or KV caches differ"
        )


class DecodeInputs(NamedTuple):
    """The first `size` rows of each `DecodeBuffers` tensor: what a graph of that size reads.

    Views, not copies: a write into the buffers is what the next replay sees.
    """

    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    slot_block_ids: torch.Tensor  # [num_tables, size] int64, each new token's block per table
    slot_offsets: torch.Tensor  # [size] int64, offset inside that block
    block_tables: torch.Tensor  # [size, max_blocks * num_tables] int32, tables interleaved
    context_lens: torch.Tensor  # [size] int32, tokens attended, the new one included


class DecodeBuffers:
    """Static input and metadata buffers for `num_rows` decode rows, one token per row.

    `fill(size, ...)` copies a batch of n <= size real rows to rows 0..n-1 and puts rows
    n..size-1 in the padding state. A padding row writes its K/V into offset 0 of a scratch
    block that no request owns (`padding_block_id`) and attends over that one token, so it
    never touches a request's KV and never reads a stale or uninitialized block id:

        row       input_id  position  slot (block, offset)   block_tables row    context_len
        0..n-1    real      real      real                   real, then pad pad  real
        n..size-1 0         0         (pad, 0)               pad pad ... pad     1
        size..    untouched: the graph of `size` never reads them

    Columns of a real row beyond its table's width are also set to the padding block. All
    padding rows write the same slot; what they compute is discarded, and the K/V they race
    to write is finite. Rows keep int64 ids/positions/slots (as the eager runner builds
    them) and int32 block tables and lengths (as kernels index them).

    Args:
        num_rows: rows of the largest captured graph.
        max_blocks: block table width, `ceil(max_model_len / block_size)`.
        padding_block_id: a block of the KV cache reserved for padding (never allocated to a
            request); its contents are garbage.
        device: where the buffers live (the KV cache's device).
        num_tables: KV tables per request (tandem.model.layer_groups.KVLayout): a row's
            tables interleaved in one row of block_tables, a slot block per table.
    """

    def __init__(
        self,
        num_rows: int,
        max_blocks: int,
        padding_block_id: int,
        device: torch.device | str,
        num_tables: int = 1,
    ) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        if padding_block_id < 0:
            raise ValueError(f"padding_block_id must be >= 0, got {padding_block_id}")
        self.num_rows = num_rows
        self.num_tables = num_tables
        self.max_blocks = max_blocks * num_tables
        self.padding_block_id = padding_block_id
        self.device = torch.device(device)
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.empty(num_rows, dtype=i64, device=device)
        self.positions = torch.empty(num_rows, dtype=i64, device=device)
        self.slot_block_ids = torch.empty(num_tables, num_rows, dtype=i64, device=device)
        self.slot_offsets = torch.empty(num_rows, dtype=i64, device=device)
        self.block_tables = torch.empty(num_rows, self.max_blocks, dtype=i32, device=device)
        self.context_lens = torch.empty(num_rows, dtype=i32, device=device)
        self.reset()

    def views(self, size: int) -> DecodeInputs:
        """Views of rows 0..size-1 (what the graph of `size` is captured with)."""
        self._check_size(size)
        return DecodeInputs(
            self.input_ids[:size],
            self.positions[:size],
            self.slot_block_ids[:, :size],
            self.slot_offsets[:size],
            self.block_tables[:size],
            self.context_lens[:size],
        )

    def reset(self) -> None:
        """Put every row in the padding state (safe to run a graph of any size on)."""
        self._pad(0, self.num_rows)

    def fill(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_block_ids: torch.Tensor,
        slot_offsets: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> None:
        """Copy n real rows to rows 0..n-1 and pad rows n..size-1.

        Checks shapes only (never values, which would sync with the device).

        Args:
            size: the graph size about to replay.
            input_ids, positions, slot_offsets, context_lens: [n]
            slot_block_ids: [num_tables, n]
            block_tables: [n, width], width <= max_blocks (tables interleaved).

        Raises:
            ValueError: size outside 1..num_rows, n > size, rows of differing lengths, or a
                block table wider than max_blocks.
        """
        self._check_size(size)
        n = input_ids.shape[0]
        if n > size:
            raise ValueError(f"batch of {n} rows does not fit a graph of size {size}")
        for name, t in (
            ("input_ids", input_ids),
            ("positions", positions),
            ("slot_offsets", slot_offsets),
            ("context_lens", context_lens),
        ):
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")
        if tuple(slot_block_ids.shape) != (self.num_tables, n):
            raise ValueError(
                f"slot_block_ids has shape {tuple(slot_block_ids.shape)}, expected "
                f"({self.num_tables}, {n})"
            )
        if block_tables.dim() != 2 or block_tables.shape[0] != n:
            raise ValueError(
                f"block_tables has shape {tuple(block_tables.shape)}, expected ({n}, width)"
            )
        width = block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(
                f"block tables are {width} blocks wide, max_blocks is {self.max_blocks}"
            )
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_block_ids[:, :n].copy_(slot_block_ids)
        self.slot_offsets[:n].copy_(slot_offsets)
        self.context_lens[:n].copy_(context_lens)
        self.block_tables[:n, :width].copy_(block_tables)
        self.block_tables[:n, width:].fill_(self.padding_block_id)
        self._pad(n, size)

    def _pad(self, start: int, end: int) -> None:
        self.input_ids[start:end].fill_(0)
        self.positions[start:end].fill_(0)
        self.slot_block_ids[:, start:end].fill_(self.padding_block_id)
        self.slot_offsets[start:end].fill_(0)
        self.block_tables[start:end].fill_(self.padding_block_id)
        self.context_lens[start:end].fill_(1)

    def _check_size(self, size: int) -> None:
        if not 1 <= size <= self.num_rows:
            raise ValueError(f"size {size} is outside 1..{self.num_rows}")


class DecodeGraphs:
    """One captured CUDA graph per batch size, replayed over `DecodeBuffers`.

    Args:
        buffers: the static buffers, on a CUDA device.
        sizes: sizes to capture, sorted ascending, the largest <= buffers.num_rows.

    Raises:
        ValueError: buffers not on CUDA (graphs need CUDA), or bad sizes.
    """

    device_type = "cuda"  # where the buffers must live (a CPU stand-in in tests: "cpu")

    def __init__(self, buffers: DecodeBuffers, sizes: Sequence[int]) -> None:
        if buffers.device.type != self.device_type:
            raise ValueError(
                f"CUDA graphs need a {self.device_type.upper()} device; the buffers are on "
                f"{buffers.device}"
            )
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be positive, sorted and unique, got {list(sizes)}")
        if sizes[-1] > buffers.num_rows:
            raise ValueError(f"largest size {sizes[-1]} exceeds the {buffers.num_rows} buffer rows")
        self.buffers = buffers
        self.sizes = tuple(sizes)
        self.captured: list[int] = []  # sizes captured so far, in capture order
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: torch.cuda._POOL_HANDLE | None = None  # the graphs' memory pool

    def capture(self, run_fn: Callable[[DecodeInputs], torch.Tensor]) -> None:
        """Capture `run_fn(buffers.views(size))` for every size, in `capture_order`.

        `run_fn` must read its inputs only from the views and return one tensor whose first
        dimension is the row. Each size runs once eagerly first (lazy initialization, Triton
        compilation and allocator growth must not happen inside a capture), on all-padding
        rows, so warm-up writes only the padding block. Largest first, in one memory pool: the
        smaller graphs reuse what the larger ones freed.

        With tensor parallelism `run_fn` runs collectives: every rank calls this with the
        same sizes at the same point of its step sequence; each size's eager run is then a
        collective step of the group, and each capture records the same collectives on
        every rank (NCCL pairs a graph's collectives with the graphs the other ranks
        captured at the same time).
        """
        for size in capture_order(self.sizes):
            self.buffers.reset()
            inputs = self.buffers.views(size)
            self._warm_up(run_fn, inputs)
            self._record(size, run_fn, inputs)
            self.captured.append(size)

    def _warm_up(
        self, run_fn: Callable[[DecodeInputs], torch.Tensor], inputs: DecodeInputs
    ) -> None:
        """One eager run before a capture, on a side stream (as torch asks of warm-up
        before capturing work that holds NCCL collectives), then the device idle: nothing
        of it (or of an eager step's collective) is in flight when the capture begins."""
        device = self.buffers.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run_fn(inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)

    def _record(
        self, size: int, run_fn: Callable[[DecodeInputs], torch.Tensor], inputs: DecodeInputs
    ) -> None:
        """Capture `run_fn(inputs)` as the graph of `size` (on torch's capture stream; a
        collective joins the process group's NCCL stream to the capture and back)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = run_fn(inputs)
        torch.cuda.synchronize(self.buffers.device)
        self._graphs[size] = graph
        self._outputs[size] = output

    def _launch(self, size: int) -> torch.Tensor:
        """Replay the graph of `size` on the current stream; its static output."""
        self._graphs[size].replay()
        return self._outputs[size]

    def can_serve(self, n: int) -> bool:
        """Whether a decode-only step of n rows can replay a captured graph."""
        return bool(self.captured) and 1 <= n <= self.sizes[-1]

    def replay(
        self,
        n: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_block_ids: torch.Tensor,
        slot_offsets: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Fill the buffers with n real rows, replay the graph of `graph_size_for(n)`.

        Returns:
            rows [:n] of the graph's output: a view of its static output tensor, overwritten
            by the next replay, so read (or copy) it first.
        """
        if input_ids.shape[0] != n:
            raise ValueError(f"n is {n} but input_ids has {input_ids.shape[0]} rows")
        size = graph_size_for(n, self.sizes)
        if size is None or size not in self.captured:
            raise ValueError(f"no captured graph holds {n} rows (sizes {list(self.sizes)})")
        self.buffers.fill(
            size, input_ids, positions, slot_block_ids, slot_offsets, block_tables, context_lens
        )
        return self._launch(size)[:n]
