"""Leases on handed-off KV blocks: the prefill side's rule for "never decode on freed blocks".

A prefill worker pins a prompt's blocks when it hands the request off and grants a lease
(id, epoch, expiry). The decode worker reads the blocks, then confirms the lease. Blocks go
back to the pool exactly once: on confirm, on expiry, or on revoke (abort).

    grant(r) ---- read ---- confirm(id, r, epoch)   valid: expiry still ahead at confirm
         \\________ expire(now) frees them at expires_at <= now; a later confirm is refused

A confirm that arrives after the expiry instant but before `expire` ran still finds the
lease: the blocks are released now, but the answer is *not valid*, because the pool may
already have been told they were free while the reader was copying them. The reader then
discards its copy (fail closed). Pure: the clock is injected; a lock makes it safe to
confirm from the gRPC thread while the engine thread expires.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from tandem.transfer.base import RemoteKV
from tandem.transfer.sections import HandoffSection


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    request_id: str
    epoch: int  # the granting worker's incarnation: a restarted worker's leases never match
    expires_at: float  # in the table's clock (wall-clock seconds by default)


class Confirmation(NamedTuple):
    """Answer to a confirm.

    valid: the blocks stayed pinned for the whole read; the reader may use its copy.
    release: request whose blocks the owner must now free (None: nothing to free here,
        because the lease was unknown, already expired and freed, or not this caller's).
    """

    valid: bool
    release: str | None


class LeaseTable:
    """Outstanding leases of one prefill worker.

    Args:
        ttl_s: how long handed-off blocks stay pinned awaiting the reader.
        epoch: this worker's incarnation, carried by every lease it grants.
        clock: seconds; leases expire against it.
        new_id: lease id factory (tests pass a deterministic one).
    """

    def __init__(
        self,
        ttl_s: float,
        epoch: int,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.epoch = epoch
        self._clock = clock
        self._new_id = new_id
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, request_id: str) -> Lease:
        """Pin `request_id`'s blocks until now + ttl_s."""
        lease = Lease(self._new_id(), request_id, self.epoch, self._clock() + self.ttl_s)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def confirm(self, lease_id: str, request_id: str, epoch: int) -> Confirmation:
        """The reader finished with the blocks of `request_id` under `lease_id`."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.request_id != request_id or lease.epoch != epoch:
                # Unknown (expired and freed already) or someone else's: touch nothing.
                return Confirmation(valid=False, release=None)
            del self._leases[lease_id]
            # The blocks were pinned for the whole read only if the lease is live *now*
            # that the reader has finished.
            return Confirmation(valid=lease.expires_at > self._clock(), release=request_id)

    def expire(self) -> list[Lease]:
        """Remove and return the leases whose expiry has come (expires_at <= now); the
        caller frees their blocks."""
        now = self._clock()
        with self._lock:
            expired = [x for x in self._leases.values() if x.expires_at <= now]
            for lease in expired:
                del self._leases[lease.lease_id]
        return expired

    def holds(self, request_id: str) -> bool:
        """Does a lease pin `request_id`'s blocks?"""
        with self._lock:
            return any(x.request_id == request_id for x in self._leases.values())

    def revoke(self, request_id: str) -> list[Lease]:
        """Remove and return every lease of `request_id` (the request was aborted; its
        blocks are freed by the abort itself)."""
        with self._lock:
            gone = [x for x in self._leases.values() if x.request_id == request_id]
            for lease in gone:
                del self._leases[lease.lease_id]
        return gone


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """What a prefill worker hands the decode worker with token 1: where the prompt's
    blocks are, how they are laid out, and the lease that keeps them pinned.

    Attributes:
        remote: the owner's blocks, as its transport exported them (with their layout).
        block_size: tokens per block on the owner (must match the reader's, and equals
            `remote.layout.block_size`).
        num_tokens: prompt tokens whose KV the blocks hold.
        owner_address: the owner's gRPC address, where the lease is confirmed.
        lease_id, epoch: identify the lease; expires_at is when it lapses (owner's clock).
        signature: the owner's HMAC over every other field, the request id and the prompt's
            hashes (`tandem.transfer.signing`); empty when the cluster has no secret.
        sections: which of the blocks hold what (`tandem.transfer.sections`): the prompt's
            KV pages, then a linear-attention model's state; empty: all KV pages.
    """

    remote: RemoteKV
    block_size: int
    num_tokens: int
    owner_address: str
    lease_id: str
    epoch: int
    expires_at: float
    signature: bytes = b""
    sections: tuple[HandoffSection, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sections", tuple(self.sections))
        if self.block_size != self.remote.layout.block_size:
            raise ValueError(
                f"block_size {self.block_size} differs from the handle's layout "
                f"({self.remote.layout.block_size} tokens per block)"
            )
