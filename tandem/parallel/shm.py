"""Collectives through shared memory, for the ranks of a tensor-parallel worker on one host.

gloo moves a tensor between two processes of one host over loopback TCP: 0.5-1 ms a call
for the few KiB a decode step exchanges, and a step makes 2-4 calls a layer (122 for
SmolLM2 with exact sums), so on a CPU the collectives, not the matmuls, set the step time.
Here the ranks share one file in /dev/shm:

    [flags: one int64 per rank, 64 bytes apart][slots: 2 parities x size ranks x slot_bytes]

A collective (`ShmExchange.gather`) is the group's n-th: each rank writes its tensor into
its slot of parity n % 2, sets its flag to n, waits until every other rank's flag reaches
n and reads their slots. The caller then combines the parts itself, every rank in the same
order (an all-reduce adds rank 0's part first, then rank 1's, ...), so every rank gets the
same bits.

- Two parities suffice: a rank writes parity n % 2 again at call n + 2 only after seeing
  every flag reach n + 1, i.e. after every other rank has finished reading call n.
- Ordering: on x86-64 a core's stores become visible to the others in program order and
  loads are not reordered with older loads (TSO), so a flag seen at n means that rank's
  slot already holds call n's bytes. Other architectures would need fences Python cannot
  issue: there the group keeps gloo (`available`).
- Waiting: a short spin (a step's collectives usually meet within microseconds), then
  `sched_yield` (releases the GIL and the core to a rank that shares it), then short
  sleeps; a peer whose process is gone ends the wait with RuntimeError (normally the
  worker's rank watcher has ended this process first: tandem.engine.ranks).
- A message larger than a slot goes through gloo: the decision depends only on shapes
  every rank knows, so every rank takes it alike (large prefill chunks, where one call's
  cost is amortized over many tokens).
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import platform
import sys
import time
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist

FLAG_STRIDE = 64  # bytes between two ranks' flags: one cache line each
SLOT_BYTES = 4 << 20  # per rank and parity; larger messages use gloo
SPINS = 2000  # flag checks before yielding
YIELDS = 20000  # sched_yield calls before sleeping
SLEEP_S = 50e-6
CHECK_PEERS_S = 1.0  # how often a long wait checks that its peers still run
TIMEOUT_S = 600.0  # as tandem.parallel.group.COLLECTIVE_TIMEOUT


def available() -> bool:
    """Whether shared-memory collectives are safe here: x86-64 Linux (see the module doc)."""
    return sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class ShmExchange:
    """One rank's view of the group's shared file (see the module doc).

    Args:
        buf: the mapped file (uint8), the same bytes in every rank.
        rank, size: this rank's place in the group.
        pids: every rank's process id, by rank (to tell a dead peer from a slow one).
        slot_bytes: bytes of one slot.
    """

    def __init__(
        self, buf: torch.Tensor, rank: int, size: int, pids: Sequence[int], slot_bytes: int
    ) -> None:
        if buf.numel() != file_bytes(size, slot_bytes):
            raise ValueError(f"{buf.numel()} bytes for {size} ranks of {slot_bytes}-byte slots")
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self._pids = list(pids)
        self._buf = buf
        # The flags through numpy: a Python-level read is ~0.1 us (a torch index is ~2 us).
        flags = buf[: size * FLAG_STRIDE].view(torch.int64).numpy()
        self._flags = flags[:: FLAG_STRIDE // 8]
        self._seq = int(self._flags[rank])  # 0 in a fresh file
        self._slots = buf[size * FLAG_STRIDE :].view(2, size, slot_bytes)

    @classmethod
    def create(cls, rank: int, size: int, slot_bytes: int = SLOT_BYTES) -> ShmExchange:
        """Join the group's exchange (every rank calls it after init_process_group): rank 0
        makes the file and tells the others its name through gloo; unlinked once all have
        mapped it (the mappings keep the memory).

        Raises:
            OSError: the file cannot be made (e.g. no room in /dev/shm), on rank 0; every
                rank then raises.
        """
        nbytes = file_bytes(size, slot_bytes)
        path = os.path.join(shm_dir(), f"tandem-tp-{uuid.uuid4().hex}")
        made: list[object] = [None]
        if rank == 0:
            try:
                buf = _map(path, nbytes, create=True)
                made[0] = path
            except OSError as exc:
                made[0] = exc
        dist.broadcast_object_list(made, src=0)
        if isinstance(made[0], OSError):
            raise made[0]
        if rank != 0:
            buf = _map(str(made[0]), nbytes, create=False)
        pids = [torch.empty(1, dtype=torch.int64, device="cpu") for _ in range(size)]
        own = torch.tensor([os.getpid()], dtype=torch.int64, device="cpu")
        dist.all_gather(pids, own)  # every rank has mapped the file
        if rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(str(made[0]))
        return cls(buf, rank, size, [int(p) for p in pids], slot_bytes)

    def fits(self, nbytes: int) -> bool:
        """Whether a message of `nbytes` (the largest any rank sends) goes through here."""
        return nbytes <= self.slot_bytes

    def gather(self, x: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """Every rank's tensor of this call (rank s's of `shapes[s]`, `x`'s dtype), by rank:
        views of the slots, valid until this rank's next call but one (combine them at once).
        `x` (shaped `shapes[self.rank]`) must fit a slot (`fits`)."""
        self._seq += 1
        parity = self._seq & 1
        self._part(parity, self.rank, tuple(x.shape), x.dtype).copy_(x)
        self._flags[self.rank] = self._seq  # after the bytes: see the module doc
        for peer in range(self.size):
            if peer != self.rank:
                self._wait(peer)
        return [self._part(parity, s, tuple(shapes[s]), x.dtype) for s in range(self.size)]

    def _part(
        self, parity: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        return self._slots[parity, rank, :nbytes].view(dtype).view(shape)

    def _wait(self, peer: int) -> None:
        flags, seq = self._flags, self._seq
        for _ in range(SPINS):
            if flags[peer] >= seq:
                return
        for _ in range(YIELDS):
            if flags[peer] >= seq:
                return
            os.sched_yield()
        start = checked = time.monotonic()
        while flags[peer] < seq:
            time.sleep(SLEEP_S)
            now = time.monotonic()
            if now - checked >= CHECK_PEERS_S:
                checked = now
                if not process_runs(self._pids[peer]):
                    raise RuntimeError(
                        f"tensor-parallel rank {peer} (pid {self._pids[peer]}) is gone: "
                        f"rank {self.rank} cannot finish collective {seq}"
                    )
                if now - start > TIMEOUT_S:
                    raise RuntimeError(
                        f"tensor-parallel rank {peer} did not reach collective {seq} in "
                        f"{TIMEOUT_S:.0f} s"
                    )


def file_bytes(size: int, slot_bytes: int) -> int:
    return size * FLAG_STRIDE + 2 * size * slot_bytes


def process_runs(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie awaiting its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3]  # after "pid (comm) "
    return state not in (b"Z", b"X")


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """The file at `path` mapped shared, as uint8 (`create`: made and zeroed first)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # no room: an error now, not SIGBUS later
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    os.unlink(path)
                    raise
                os.ftruncate(fd, nbytes)
        buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8)
