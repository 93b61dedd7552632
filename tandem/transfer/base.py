"""The KV transfer contract shared by every transport.

An engine's KV cache is one contiguous, block-major tensor
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, so block `b` is the byte range
`[base_addr + b * block_bytes, base_addr + (b + 1) * block_bytes)`. The *owner* (a prefill worker)
registers its cache and `export`s the blocks that hold a prompt as a `RemoteKV`; the *reader* (a
decode worker) `read`s them into its own blocks (different ids) and, with the same call, tells
the owner it is done via a notification that the owner collects with `poll`. Every handle
carries its cache's `KVLayout`, and a reader refuses one whose dtype or block geometry differs
from its own cache's before it moves any byte (`LayoutMismatch`).

This module holds the contract: the handles (`RemoteKV`, and `RankKV` for each rank cache of
a tensor-parallel owner), `TransferError`, and `KVTransport`, which implements the argument
checking and bookkeeping once; a transport supplies the data movement through the `_do_*` hooks,
so every implementation fails the same way on misuse. A read moves coalesced block runs
(`tandem.transfer.runs`); one where either side splits the KV heads over tensor-parallel ranks
is carried out by `tandem.transfer.ranks`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar

import torch

from tandem.transfer.layout import KVLayout, check_compatible
from tandem.transfer.ranks import ranks_layout, read_heads, staging_buffer
from tandem.transfer.runs import coalesce

TRANSPORT_KINDS = ("nixl", "local")


@dataclass(frozen=True, slots=True)
class RankKV:
    """One tensor-parallel rank's cache in a handle: block b of the rank is at `base_addr +
    b * (block_bytes of its num_heads heads)`, and it holds the model's KV heads
    [head_start, head_start + num_heads) (ranks past the KV heads' count hold replicas)."""

    base_addr: int
    head_start: int
    num_heads: int

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_start + self.num_heads)


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """What an owner hands to a reader: enough to read `block_ids` out of its KV cache.

    Attributes:
        transport: kind of transport that exported it ("nixl" or "local"); a reader only
            accepts handles of its own kind.
        agent_name: the owner's agent name (unique in the deployment).
        agent_metadata: opaque connection info of the owner; it changes when the owner
            restarts, which is how a reader notices that its cached connection is stale.
        base_addr: address of the owner's block 0 in the owner's address space.
        block_bytes: bytes per block; must equal `layout.block_bytes` (and the reader's).
        block_ids: the owner's blocks, in prompt order (may repeat; may be empty).
        layout: memory type, device, dtype and block geometry of the owner's cache; a reader
            only accepts a handle whose layout is compatible with its own cache's. For a
            tensor-parallel owner, the model's whole KV (every head; `num_kv_heads` is the
            model's), held by `ranks`.
        ranks: a tensor-parallel owner's caches, rank 0 first (at `base_addr`); each holds a
            range of the layout's heads, together all of them. Empty: one cache holding every
            head, at `base_addr`.
    """

    transport: str
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    block_ids: tuple[int, ...]
    layout: KVLayout
    ranks: tuple[RankKV, ...] = ()

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORT_KINDS:
            raise ValueError(f"transport must be one of {TRANSPORT_KINDS}, got {self.transport!r}")
        if not self.agent_name:
            raise ValueError("agent_name must be a non-empty string")
        if self.base_addr < 0:
            raise ValueError(f"base_addr must be >= 0, got {self.base_addr}")
        if self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {self.block_bytes}")
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        if self.block_bytes != self.layout.block_bytes:
            raise ValueError(
                f"block_bytes {self.block_bytes} does not match the layout's block size of "
                f"{self.layout.block_bytes} bytes ({self.layout.dtype}, {self.layout.num_layers} "
                f"layers, {self.layout.block_size} tokens, {self.layout.num_kv_heads} KV heads "
                f"of {self.layout.head_dim})"
            )
        # Accept any sequence (a protobuf repeated field, a list) but store an immutable tuple so
        # that the handle stays hashable and cannot change under a reader.
        ids = tuple(int(b) for b in self.block_ids)
        negative = [b for b in ids if b < 0]
        if negative:
            raise ValueError(f"block_ids must be >= 0, got {negative[:8]}")
        object.__setattr__(self, "block_ids", ids)
        ranks = tuple(self.ranks)
        object.__setattr__(self, "ranks", ranks)
        if ranks:
            heads = self.layout.num_kv_heads
            for r in ranks:
                if not isinstance(r, RankKV) or r.num_heads <= 0 or r.head_start < 0:
                    raise ValueError(f"ranks must be RankKVs with heads, got {r!r}")
                if r.head_start + r.num_heads > heads or r.base_addr < 0:
                    raise ValueError(f"rank {r} lies outside the layout's {heads} KV heads")
            held = {h for r in ranks for h in r.heads}
            if len(held) != heads:
                raise ValueError(f"ranks hold KV heads {sorted(held)}, not all {heads}")
            if ranks[0].base_addr != self.base_addr:
                raise ValueError("ranks[0] must be the cache at base_addr")

    @property
    def sources(self) -> tuple[RankKV, ...]:
        """The caches holding this handle's heads (one, holding all, without `ranks`)."""
        return self.ranks or (RankKV(self.base_addr, 0, self.layout.num_kv_heads),)

    @property
    def num_bytes(self) -> int:
        """Bytes a full read of this handle moves."""
        return len(self.block_ids) * self.block_bytes


class TransferError(RuntimeError):
    """A read could not complete: peer unknown, dead or restarted, timeout, or transport error.

    The reader's destination blocks hold undefined data after this error; the owner's blocks are
    untouched (reads never write to the owner).
    """


class KVTransport(ABC):
    """Moves KV blocks between engines' caches; one instance per engine (one agent).

    Lifecycle: construct, `register` the KV cache once, then any number of `export` (owner),
    `read` (reader) and `poll` (owner) calls, then `close`. A transport may be owner and reader
    at once. Calling anything but `close` after `close`, or `export`/`read` before `register`,
    raises RuntimeError.

    Thread-safety: an instance must be used from one thread at a time; callers serialize.
    (Both implementations tolerate a progress thread that calls `poll` concurrently with the
    other methods; see their docstrings.)

    Attributes:
        agent_name: this agent's name, unique in the deployment.
        last_num_descriptors: transfer descriptors the last `read` used (one per coalesced run);
            exposed so that tests and metrics can see that coalescing happened.
    """

    kind: ClassVar[str]

    def __init__(self, agent_name: str) -> None:
        if not isinstance(agent_name, str) or not agent_name:
            raise ValueError(f"agent_name must be a non-empty string, got {agent_name!r}")
        self.agent_name = agent_name
        self.last_num_descriptors = 0
        self._kv: torch.Tensor | None = None
        self._layout: KVLayout | None = None
        self._block_bytes = 0
        self._closed = False
        self._ranks: tuple[tuple[torch.Tensor, int], ...] = ()
        self._staging: torch.Tensor | None = None

    # ----------------------------------------------------------------------------- properties

    @property
    def registered(self) -> bool:
        """Whether `register` has been called."""
        return self._kv is not None

    @property
    def kv_cache(self) -> torch.Tensor:
        """The registered KV cache tensor."""
        return self._require_kv()

    @property
    def num_blocks(self) -> int:
        """Blocks in the registered KV cache."""
        return int(self._require_kv().shape[0])

    @property
    def block_bytes(self) -> int:
        """Bytes per block of the registered KV cache."""
        self._require_kv()
        return self._block_bytes

    @property
    def layout(self) -> KVLayout:
        """Layout of the registered KV cache (what every exported handle carries)."""
        self._require_kv()
        assert self._layout is not None  # set together with _kv
        return self._layout

    @property
    def base_addr(self) -> int:
        """Address of block 0 of the registered KV cache."""
        return int(self._require_kv().data_ptr())

    # -------------------------------------------------------------------------------- contract

    def register(
        self,
        kv_cache: torch.Tensor,
        scales: tuple[tuple[float, ...], tuple[float, ...]] = ((), ()),
        ranks: Sequence[tuple[torch.Tensor, int]] = (),
    ) -> None:
        """Register this engine's KV cache (block-major, dim 0 indexes blocks) for transfers.
        `scales`: (k_scales, v_scales) of a scaled (fp8) cache, one per layer; they join
        its layout (the manifest every handle carries and every read checks).
        `ranks`: a tensor-parallel engine's caches (rank 0's, `kv_cache`, first), each with
        the first model KV head it holds, all mapped in this process: every handle then
        carries them (`RemoteKV.ranks`), the layout counts every head, and a read writes
        each rank's heads into its cache.

        Call once, before `export` or `read`. The tensor must stay alive and must not be
        reallocated until `close`. Its `KVLayout` (memory type and device from the tensor's
        device, dtype, and the block geometry from its shape) goes into every exported handle
        and is what `read` checks handles against.

        Raises:
            ValueError: not a tensor, not contiguous, not of the engine cache's shape
                `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, zero blocks
                or empty blocks, or a cache is already registered.
        """
        self._check_open()
        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        if self._kv is not None:
            raise ValueError(
                f"agent {self.agent_name!r} already has a registered KV cache "
                f"(shape {tuple(self._kv.shape)}); register() is called once"
            )
        if not kv_cache.is_contiguous():
            raise ValueError(
                f"kv_cache must be contiguous (shape {tuple(kv_cache.shape)}, "
                f"stride {kv_cache.stride()}); blocks are addressed as byte ranges"
            )
        if kv_cache.dim() < 1 or kv_cache.shape[0] == 0 or kv_cache.numel() == 0:
            raise ValueError(
                f"kv_cache must have at least one non-empty block, got shape "
                f"{tuple(kv_cache.shape)}"
            )
        layout = KVLayout.of_cache(kv_cache, scales)
        block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        assert block_bytes == layout.block_bytes, (block_bytes, layout)
        rank_caches = tuple((t, int(start)) for t, start in ranks)
        if rank_caches:
            layout = ranks_layout(kv_cache, rank_caches, layout)
            block_bytes = layout.block_bytes
        self._do_register(kv_cache, tuple(t for t, _ in rank_caches[1:]))
        # Only after the transport accepted it, so that a failed register can be retried.
        self._kv = kv_cache
        self._layout = layout
        self._block_bytes = block_bytes
        self._ranks = rank_caches

    def export(self, block_ids: Sequence[int]) -> RemoteKV:
        """Describe some of this engine's blocks for a reader.

        Raises:
            ValueError: a block id is out of range.
            RuntimeError: nothing registered, or closed.
        """
        self._check_open()
        num_blocks = self.num_blocks
        ids = tuple(int(b) for b in block_ids)
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"block ids out of range [0, {num_blocks}): {bad[:8]}")
        return RemoteKV(
            transport=self.kind,
            agent_name=self.agent_name,
            agent_metadata=self._metadata(),
            base_addr=self.base_addr,
            block_bytes=self._block_bytes,
            block_ids=ids,
            layout=self.layout,
            ranks=tuple(RankKV(t.data_ptr(), start, int(t.shape[4])) for t, start in self._ranks),
        )

    def read(
        self,
        remote: RemoteKV,
        local_block_ids: Sequence[int],
        notif: bytes = b"",
        timeout_s: float = 10.0,
    ) -> int:
        """Copy `remote.block_ids[i]` into local block `local_block_ids[i]`, for all i; block.

        Adjacent ids that are consecutive on both sides travel as one descriptor. After the data
        has landed, `notif` (if non-empty) is delivered to the owner, whose `poll` returns it;
        with no blocks to read, a non-empty `notif` is still delivered. The owner must keep
        calling `poll` while reads may be in flight: some transports need the owner's progress
        to connect or to deliver `notif`, and a read then waits for it (up to `timeout_s`).

        Returns:
            Bytes moved (`len(local_block_ids) * block_bytes`).

        Raises:
            LayoutMismatch (a ValueError): `remote.layout` differs from this cache's layout in
                dtype, order or block geometry (`check_compatible`); nothing was read and no
                notification was sent.
            ValueError: lengths differ, a local id is out of range or repeated, `remote` comes
                from another kind of transport, `notif` is not bytes, or `timeout_s` is not
                positive.
            TransferError: the peer is unknown, dead or restarted (stale `remote`), a remote
                block is not in the peer's registered memory, the transport failed, or the
                read did not finish within `timeout_s` (it is then cancelled).
            RuntimeError: nothing registered, or closed.
        """
        self._check_open()
        num_blocks = self.num_blocks
        if not isinstance(remote, RemoteKV):
            raise ValueError(f"remote must be a RemoteKV, got {type(remote).__name__}")
        if remote.transport != self.kind:
            raise ValueError(
                f"remote was exported by a {remote.transport!r} transport; this one is "
                f"{self.kind!r}"
            )
        check_compatible(remote.layout, self.layout)
        # Compatible layouts have equal block sizes, and a handle's block_bytes is its layout's.
        assert remote.block_bytes == self._block_bytes, (remote.block_bytes, self._block_bytes)
        if not isinstance(notif, bytes):
            raise ValueError(f"notif must be bytes, got {type(notif).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        local = [int(b) for b in local_block_ids]
        if len(local) != len(remote.block_ids):
            raise ValueError(
                f"local_block_ids has {len(local)} blocks but remote.block_ids has "
                f"{len(remote.block_ids)}"
            )
        bad = [b for b in local if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"local block ids out of range [0, {num_blocks}): {bad[:8]}")
        if len(set(local)) != len(local):
            # Two remote blocks into one local block is a caller bug, and the result would
            # depend on the order in which the transport happens to complete descriptors.
            raise ValueError(f"local_block_ids has repeated ids: {sorted(local)[:8]}...")
        if remote.ranks or self._ranks:
            # Either side splits the KV heads: each rank cache gets its heads (ranks.py); the
            # notification follows the last read. Bytes moved are those over the transport.
            sources = remote.sources
            moved, self.last_num_descriptors = read_heads(
                [src.heads for src in sources],
                self._ranks or ((self._require_kv(), 0),),
                self.layout,
                remote.block_ids,
                local,
                lambda i, runs, dst: self._do_read_into(remote, sources[i], runs, dst, timeout_s),
                self._staging_buffer,
            )
            if notif:
                self._do_read(remote, [], notif, timeout_s)
            return moved
        runs = coalesce(remote.block_ids, local)
        self.last_num_descriptors = len(runs)
        self._do_read(remote, runs, notif, timeout_s)
        return len(local) * self._block_bytes

    def _staging_buffer(self, block_bytes: int) -> torch.Tensor:
        """The registered staging buffer of head-split reads (`ranks.staging_buffer`)."""
        self._staging = staging_buffer(
            self._staging, block_bytes, self.kv_cache.device, self._do_register_staging
        )
        return self._staging

    @abstractmethod
    def poll(self) -> list[bytes]:
        """Owner side: drive the transport's progress and return the notifications received
        since the last call (in arrival order per reader). Cheap; call it regularly."""

    @abstractmethod
    def forget_peer(self, agent_name: str) -> None:
        """Drop any cached connection to `agent_name` (e.g. it restarted); unknown names are
        ignored. The next `read` from that peer reconnects with the metadata it carries."""

    def close(self) -> None:
        """Release the registration and every connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._do_close()
        finally:
            self._kv = None
            self._layout = None
            self._ranks = ()
            self._staging = None

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("registered" if self.registered else "new")
        return f"{type(self).__name__}(agent_name={self.agent_name!r}, {state})"

    # ---------------------------------------------------------------------- transport hooks

    @abstractmethod
    def _do_register(self, kv_cache: torch.Tensor, others: tuple[torch.Tensor, ...] = ()) -> None:
        """Make `kv_cache` (validated: contiguous, >= 1 non-empty block) readable by peers,
        and `others` (a tensor-parallel engine's other ranks' caches) too."""

    @abstractmethod
    def _do_register_staging(self, staging: torch.Tensor) -> None:
        """Make `staging` (uint8, on the cache's device) a destination of `_do_read_into`
        (it replaces any earlier staging buffer)."""

    @abstractmethod
    def _do_read_into(
        self,
        remote: RemoteKV,
        source: RankKV,
        runs: list[tuple[int, int, int]],
        dst: torch.Tensor,
        timeout_s: float,
    ) -> None:
        """Copy runs of `source`'s blocks (`source.num_heads` heads each) into blocks of the
        same size at `dst` (a registered rank cache or the staging buffer)."""

    @abstractmethod
    def _metadata(self) -> bytes:
        """This agent's current connection metadata (after registration)."""

    @abstractmethod
    def _do_read(
        self, remote: RemoteKV, runs: list[tuple[int, int, int]], notif: bytes, timeout_s: float
    ) -> None:
        """Execute validated, coalesced runs (possibly none) and deliver `notif` if non-empty."""

    @abstractmethod
    def _do_close(self) -> None:
        """Release transport resources; called once."""

    # -------------------------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transport {self.agent_name!r} is closed")

    def _require_kv(self) -> torch.Tensor:
        self._check_open()
        if self._kv is None:
            raise RuntimeError(f"transport {self.agent_name!r} has no KV cache; call register()")
        return self._kv
