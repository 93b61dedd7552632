"""KV cache transfer between engines: a reader pulls an owner's blocks into its own cache.

    owner = make_transport("nixl", "prefill-0"); owner.register(kv_cache)
    handle = owner.export(block_ids)                 # RemoteKV (with the cache's KVLayout)
    reader.read(handle, local_block_ids, notif=b"req-42")   # LayoutMismatch: nothing read
    owner.poll()                                     # -> [b"req-42"]: the blocks may be freed

A hand-off (`KVHandoff`: the handle, its lease, the owner's address) is signed by its owner
and verified by the reader before any read (`tandem.transfer.signing`).

`"nixl"` moves data between processes (and hosts) with NIXL; `"local"` copies between engines
of one process. Both honour the `KVTransport` contract in `tandem.transfer.base`.

Modules: `base` (the contract: handles, `TransferError`, `KVTransport`), `layout` (what the
bytes are), `runs` (block runs, one descriptor each), `ranks` (reads that split KV heads over
tensor-parallel ranks), `plan` (which blocks a decode worker reads), `lease` and `signing`
(the hand-off), `local`, and `nixl` with `hugepages` (its CPU caches on huge pages).
"""

from __future__ import annotations

from tandem.transfer.base import TRANSPORT_KINDS, KVTransport, RankKV, RemoteKV, TransferError
from tandem.transfer.layout import KVLayout, LayoutMismatch, check_compatible, layout_diff
from tandem.transfer.lease import Confirmation, KVHandoff, Lease, LeaseTable
from tandem.transfer.local import LocalTransport
from tandem.transfer.plan import ReadPlan, plan_read
from tandem.transfer.runs import coalesce
from tandem.transfer.signing import prompt_hashes, sign_handoff, verify_handoff

__all__ = [
    "TRANSPORT_KINDS",
    "Confirmation",
    "KVHandoff",
    "KVLayout",
    "KVTransport",
    "Lease",
    "RankKV",
    "LayoutMismatch",
    "LeaseTable",
    "LocalTransport",
    "ReadPlan",
    "RemoteKV",
    "TransferError",
    "check_compatible",
    "coalesce",
    "layout_diff",
    "make_transport",
    "plan_read",
    "prompt_hashes",
    "sign_handoff",
    "verify_handoff",
]


def make_transport(kind: str, agent_name: str) -> KVTransport:
    """A new, unregistered transport of `kind` ("nixl" or "local") named `agent_name`.

    NIXL is imported only when asked for, so the local transport works without loading it.

    Raises:
        ValueError: unknown `kind` or empty `agent_name`.
        TransferError: the NIXL agent could not be created.
    """
    if kind == "local":
        return LocalTransport(agent_name)
    if kind == "nixl":
        from tandem.transfer.nixl import NixlTransport

        return NixlTransport(agent_name)
    raise ValueError(f"unknown transport kind {kind!r}; expected one of {TRANSPORT_KINDS}")
