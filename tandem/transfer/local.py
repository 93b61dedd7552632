"""In-process transport: owner and reader live in one Python process.

Used by unit tests and by the embedded single-process deployment, where prefill and decode
engines share an address space and a NIXL agent would only add overhead. Agents find each other
through a module-level registry keyed by agent name; a read is a handful of tensor slice copies
(one per coalesced run) done by the reader's thread.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections import deque

import torch

from tandem.transfer.base import KVTransport, RankKV, RemoteKV, TransferError

# agent name -> live transport. A newer transport with the same name replaces the older one,
# which is how a "restarted" owner looks in one process: handles exported by the old instance
# then fail with TransferError because their metadata no longer matches. Weak references: an
# owner that is garbage collected without close() is gone too, and its cache is not kept alive.
_REGISTRY: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


class LocalTransport(KVTransport):
    """`KVTransport` between engines of the same process.

    Reads copy raw bytes (a byte view of each cache), so they never convert dtypes; both caches
    may live on any device torch can copy between. Reads are synchronous: `timeout_s` is
    accepted for contract compatibility but nothing can hang. Notifications land in the owner's
    queue at the end of the read, and `poll` drains it (safe from another thread than the
    reader's, so owner and reader engines may run on different threads).
    """

    kind = "local"

    def __init__(self, agent_name: str) -> None:
        super().__init__(agent_name)
        # Unique per instance: plays the role of NIXL's agent metadata, so a handle exported
        # before a "restart" is recognizably stale.
        self._token = f"local:{agent_name}:{uuid.uuid4().hex}".encode()
        self._notifs: deque[bytes] = deque()
        self._rows: torch.Tensor | None = None  # [num_blocks, block_bytes] uint8 view
        self._rank_rows: dict[int, torch.Tensor] = {}
        with _REGISTRY_LOCK:
            _REGISTRY[agent_name] = self

    def poll(self) -> list[bytes]:
        """Drain and return the notifications delivered to this agent since the last call."""
        self._check_open()
        out: list[bytes] = []
        while True:
            try:
                out.append(self._notifs.popleft())
            except IndexError:
                return out

    def forget_peer(self, agent_name: str) -> None:
        """No-op: peers are looked up in the registry on every read; nothing is cached."""
        self._check_open()

    # ---------------------------------------------------------------------- transport hooks

    def _do_register(
        self, kv_cache: torch.Tensor, others: tuple[torch.Tensor, ...] = ()
    ) -> None:
        self._rows = _rows(kv_cache)
        # Every rank's cache by address (a tensor-parallel engine's; read by `RankKV`).
        self._rank_rows = {t.data_ptr(): _rows(t) for t in (kv_cache, *others)}

    def _do_register_staging(self, staging: torch.Tensor) -> None:
        pass  # any tensor is a destination

    def _do_read_into(
        self,
        remote: RemoteKV,
        source: RankKV,
        runs: list[tuple[int, int, int]],
        dst: torch.Tensor,
        timeout_s: float,
    ) -> None:
        owner = self._owner(remote)
        src = owner._rank_rows.get(source.base_addr)
        bb = self.layout.block_bytes // self.layout.num_kv_heads * source.num_heads
        if src is None or int(src.shape[1]) != bb:
            raise TransferError(
                f"agent {remote.agent_name!r} has no {bb}-byte-block cache at "
                f"{source.base_addr:#x}"
            )
        bad = [b for b in remote.block_ids if b >= int(src.shape[0])]
        if bad:
            raise TransferError(f"remote block ids out of range: {bad[:8]}")
        rows = dst.view(-1).view(torch.uint8)
        for remote_start, local_start, n in runs:
            out = rows[local_start * bb : (local_start + n) * bb]
            out.copy_(src[remote_start : remote_start + n].reshape(-1))

    def _owner(self, remote: RemoteKV) -> LocalTransport:
        with _REGISTRY_LOCK:
            owner = _REGISTRY.get(remote.agent_name)
        if owner is None:
            raise TransferError(
                f"unknown local agent {remote.agent_name!r} (closed or never created)"
            )
        if owner._token != remote.agent_metadata:
            raise TransferError(
                f"stale handle: agent {remote.agent_name!r} restarted since it exported these "
                "blocks"
            )
        return owner

    def _metadata(self) -> bytes:
        return self._token

    def _do_read(
        self, remote: RemoteKV, runs: list[tuple[int, int, int]], notif: bytes, timeout_s: float
    ) -> None:
        owner = self._owner(remote)
        if remote.ranks and not runs:  # a tensor-parallel read's closing notification
            if notif:
                owner._notifs.append(notif)
            return
        src = owner._rows
        if src is None:
            raise TransferError(f"agent {remote.agent_name!r} has no registered KV cache")
        if remote.base_addr != src.data_ptr():
            raise TransferError(
                f"handle base_addr {remote.base_addr:#x} does not match agent "
                f"{remote.agent_name!r}'s registered cache at {src.data_ptr():#x}"
            )
        if int(src.shape[1]) != remote.block_bytes or owner._layout != remote.layout:
            # A forged or corrupted handle: the reader checked the handle's layout against its
            # own cache, but only the owner knows what its cache really holds.
            raise TransferError(
                f"handle says {remote.block_bytes}-byte blocks of {remote.layout}; agent "
                f"{remote.agent_name!r} registered {int(src.shape[1])}-byte blocks of "
                f"{owner._layout}"
            )
        owner_blocks = int(src.shape[0])
        bad = [b for b in remote.block_ids if b >= owner_blocks]
        if bad:
            raise TransferError(
                f"remote block ids out of agent {remote.agent_name!r}'s range "
                f"[0, {owner_blocks}): {bad[:8]}"
            )
        dst = self._rows
        assert dst is not None  # register() ran: the base class checked
        for remote_start, local_start, n in runs:
            dst[local_start : local_start + n].copy_(src[remote_start : remote_start + n])
        if notif:
            owner._notifs.append(notif)

    def _do_close(self) -> None:
        with _REGISTRY_LOCK:
            # Only our own entry: a newer instance with the same name may have replaced us.
            if _REGISTRY.get(self.agent_name) is self:
                del _REGISTRY[self.agent_name]
        self._rows = None
        self._rank_rows = {}
        self._notifs.clear()


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_bytes] uint8 view of a cache."""
    return cache.view(-1).view(torch.uint8).view(cache.shape[0], -1)
