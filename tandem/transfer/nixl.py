"""NIXL transport: one NIXL agent (UCX backend) per engine process.

Reads are one-sided NIXL READs: the reader pulls the owner's blocks straight into its own cache
(UCX picks the path: cma/process_vm_readv between processes of one host, RDMA or CUDA IPC
elsewhere). Memory type follows the registered tensor: DRAM for CPU tensors, VRAM for CUDA.

Progress model. The agent runs without NIXL's progress thread (it spins a whole core per agent),
so progress happens only inside calls into the agent: the reader drives its own transfer while
it waits in `read` (over UCX cma the reader's thread does the whole copy), and the owner must
call `poll` regularly. The owner's progress is needed to establish a connection, and a read
that carries a notification may not complete before the owner has progressed (observed for
reads of a few MiB): an owner that stops polling stalls such reads until their timeout.

Memory on the two sides may differ: the remote descriptors of a read take the memory type and
device id from the handle's `KVLayout` (the owner's registered cache), the local ones from this
agent's cache, so a DRAM reader can pull from a VRAM owner on any of its devices. What the bytes
are (dtype, block geometry) must match; the base class refuses other handles before reading.

This module holds `NixlTransport` and the UCX settings and polling rule it is tuned for; a CPU
cache is put on huge pages at registration by `tandem.transfer.hugepages`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_xfer_handle

from tandem.transfer.base import KVTransport, RankKV, RemoteKV, TransferError
from tandem.transfer.hugepages import advise_hugepages
from tandem.transfer.layout import KVLayout

logger = logging.getLogger(__name__)

_BACKEND = "UCX"
# UCX settings this transport is tuned for. UCX reads them from the environment when an agent
# creates its backend; this module only states them (the core reads no environment): a process
# applies them before it creates a transport, with
# `tandem.services.common.runtime.process.configure_native_libraries` (values already set win).
# - UCX_CMA_SEG_SIZE: UCX moves intra-host DRAM reads in process_vm_readv calls of this size
#   (default 512k); larger segments mean fewer syscalls and page-pinning rounds: measured
#   +14% for a 12 MiB read and +5% for 192 MiB. The cost, longer individual progress calls,
#   does not matter here because `read` blocks until the whole transfer is done anyway.
UCX_ENV_DEFAULTS = {"UCX_CMA_SEG_SIZE": "32m"}
# And on a CUDA worker:
# - UCX_CUDA_IPC_ENABLE_GET_ZCOPY: UCX turns cuda_ipc GETs off ("auto") on a GPU without
#   NVLink peers, and a read of VRAM then falls back to emulation over TCP: measured 0.5 GB/s
#   for 2 MiB blocks between two processes on one H200 (benchmarks/results/gpu). A transfer
#   here is always a GET (the decode worker reads), so it is turned on; peers (llm-d, Dynamo's
#   same-node setups) set the same. Only on CUDA: a CPU process's UCX has no cuda_ipc and
#   warns about an unused variable.
UCX_CUDA_ENV_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def ucx_env_defaults(device: str) -> dict[str, str]:
    """The UCX settings for a worker on `device` ("cpu", "cuda", "cuda:1")."""
    cuda = UCX_CUDA_ENV_DEFAULTS if device.startswith("cuda") else {}
    return {**UCX_ENV_DEFAULTS, **cuda}


# Polling a read. With no progress thread the data moves inside the agent's calls, so a
# read polls without pause at first: a small one is done within microseconds. But each poll
# takes the GIL, and a pull of many MiB would spin for milliseconds against the engine and
# event-loop threads of the same process; so every poll yields the GIL (sleep(0) releases
# it), and past POLL_YIELD_S each waits POLL_SLEEP_S (a long read is bound by the wire or the
# copy engine, and ~0.2 ms more does not show).
POLL_YIELD_S = 1e-3
POLL_SLEEP_S = 2e-4
_SCRATCH_BYTES = 64


def poll_pause_s(elapsed_s: float) -> float:
    """Seconds to sleep before the next poll of a read that has run `elapsed_s` (0: only
    yield the GIL)."""
    return 0.0 if elapsed_s < POLL_YIELD_S else POLL_SLEEP_S


class NixlTransport(KVTransport):
    """`KVTransport` over NIXL with the UCX backend.

    Peers are cached by agent name together with the metadata they were loaded from; a handle
    whose metadata differs (the owner restarted under the same name) replaces the cached peer
    automatically, and any failed read drops the cached peer so the next read reconnects.

    Descriptors are built per read from the coalesced runs (`initialize_xfer`); UCX spends
    about 2 us per descriptor, so coalescing matters for scattered blocks. Pre-prepared
    descriptor lists (`prep_xfer_dlist`/`make_prepped_xfer`) measured ~15 us faster for a few
    descriptors and ~0.3 ms for 512 (of a ~19 ms read): not worth a per-peer cache that needs
    the owner's block count, which `RemoteKV` does not carry.

    UCX takes its settings from the environment of the process when the agent is created:
    apply `UCX_ENV_DEFAULTS` first
    (`tandem.services.common.runtime.process.configure_native_libraries`).

    Thread-safety: callers should use an instance from one thread at a time. As a safety net
    for the common owner layout (a progress thread calling `poll` while the engine thread
    calls `export`), every call that touches the NIXL agent (`register`, `read`, `poll`,
    `forget_peer`, `close`) takes an internal lock, since the agent is created without NIXL's
    own locking; `export` only reads state fixed at `register`. A `read` holds the lock until
    it finishes, so a `poll` on the same instance waits for it.

    Args:
        agent_name: unique name of this agent in the deployment.
        backend_params: UCX backend init parameters (see
            `nixl_agent.get_plugin_params("UCX")`), e.g. {"ucx_error_handling_mode": "none"}.
        hugepages: on `register` of a CPU cache, back it with transparent huge pages
            (`advise_hugepages`): peers read it about 1.5x faster.
    """

    kind = "nixl"

    def __init__(
        self,
        agent_name: str,
        backend_params: dict[str, str] | None = None,
        hugepages: bool = True,
    ) -> None:
        super().__init__(agent_name)
        self._hugepages = hugepages
        try:
            # backends=[]: create only UCX below, with params; instantiating every plugin would
            # probe GPU/storage backends that do not work on CPU.
            agent = nixl_agent(
                agent_name,
                nixl_agent_config(
                    enable_prog_thread=False, enable_listen_thread=False, backends=[]
                ),
            )
            if _BACKEND not in agent.get_plugin_list():
                raise TransferError(
                    f"NIXL plugin {_BACKEND} unavailable; plugins: {agent.get_plugin_list()}"
                )
            agent.create_backend(_BACKEND, dict(backend_params or {}))
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"cannot create NIXL agent {agent_name!r}: {e}") from e
        self._agent: nixl_agent | None = agent
        self._lock = threading.Lock()
        self._reg: Any = None  # nixlRegDList of the registered cache, for deregistration
        self._staging_reg: Any = None  # the staging buffer's (KVTransport._staging_buffer)
        self._md = b""
        self._mem_type = "DRAM"
        self._dev_id = 0
        # peer agent name -> metadata it was loaded from
        self._peers: dict[str, bytes] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)  # registered with the cache
        self.hugepage_bytes = 0  # bytes of the cache that register() put on huge pages

    # -------------------------------------------------------------------------------- contract

    def poll(self) -> list[bytes]:
        """Drive UCX progress and return the notifications received since the last call."""
        with self._lock:
            agent = self._require_agent()
            try:
                new = agent.get_new_notifs()
            except Exception as e:
                raise TransferError(f"NIXL notification poll failed: {e}") from e
        out: list[bytes] = []
        for msgs in new.values():
            out.extend(bytes(m) for m in msgs)
        return out

    def forget_peer(self, agent_name: str) -> None:
        """Unload `agent_name`'s metadata (disconnecting it) if it is cached."""
        with self._lock:
            self._require_agent()
            self._drop_peer(agent_name)

    @property
    def peers(self) -> dict[str, bytes]:
        """Cached peers: agent name -> the metadata they were loaded from (a copy)."""
        return dict(self._peers)

    # ---------------------------------------------------------------------- transport hooks

    def _do_register(self, kv_cache: torch.Tensor, others: tuple[torch.Tensor, ...] = ()) -> None:
        with self._lock:
            self._register_locked(kv_cache, others)

    def _do_register_staging(self, staging: torch.Tensor) -> None:
        with self._lock:
            agent = self._require_agent()
            nbytes = staging.numel()
            try:
                reg = agent.register_memory(
                    [(staging.data_ptr(), nbytes, self._dev_id, "")], self._mem_type
                )
            except Exception as e:
                raise TransferError(f"NIXL cannot register a {nbytes}-byte staging buffer") from e
            if self._staging_reg is not None:
                agent.deregister_memory(self._staging_reg)
            self._staging_reg = reg

    def _do_read_into(
        self,
        remote: RemoteKV,
        source: RankKV,
        runs: list[tuple[int, int, int]],
        dst: torch.Tensor,
        timeout_s: float,
    ) -> None:
        if not runs:
            return
        deadline = time.monotonic() + timeout_s
        bb = self.layout.block_bytes // self.layout.num_kv_heads * source.num_heads
        r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        local = np.empty((len(runs), 3), dtype=np.uint64)
        local[:, 0] = dst.data_ptr() + r[:, 1] * bb
        local[:, 1] = r[:, 2] * bb
        local[:, 2] = self._dev_id
        rem = np.empty_like(local)
        rem[:, 0] = source.base_addr + r[:, 0] * bb
        rem[:, 1] = local[:, 1]
        rem[:, 2] = remote.layout.device_id
        with self._lock:
            agent = self._require_agent()
            peer = self._ensure_peer(remote)
            self._xfer_read(agent, peer, remote, local, rem, b"", deadline, timeout_s)

    def _register_locked(
        self, kv_cache: torch.Tensor, others: tuple[torch.Tensor, ...] = ()
    ) -> None:
        agent = self._require_agent()
        if not (kv_cache.is_cuda or kv_cache.device.type == "cpu"):
            raise ValueError(
                f"kv_cache must be on CPU or CUDA for NIXL, got device {kv_cache.device}"
            )
        # The same derivation as the layout every export carries (the base class sets it
        # after this hook succeeds).
        layout = KVLayout.of_cache(kv_cache)
        self._mem_type, self._dev_id = layout.memory_type, layout.device_id
        nbytes = kv_cache.numel() * kv_cache.element_size()
        if self._hugepages and self._mem_type == "DRAM":
            # Before registering: collapsing moves the data to new physical pages.
            self.hugepage_bytes = sum(advise_hugepages(t) for t in (kv_cache, *others))
        # Destination of the token read that carries a notification when there are no blocks
        # to read (see _do_read).
        scratch = torch.empty(_SCRATCH_BYTES, dtype=torch.uint8, device=kv_cache.device)
        try:
            self._reg = agent.register_memory(
                [
                    (kv_cache.data_ptr(), nbytes, self._dev_id, ""),
                    (scratch.data_ptr(), _SCRATCH_BYTES, self._dev_id, ""),
                    # A tensor-parallel engine's other ranks' caches, mapped here.
                    *((t.data_ptr(), t.nbytes, self._dev_id, "") for t in others),
                ],
                self._mem_type,
            )
            # Metadata includes the registered region, so take it after registering.
            self._md = bytes(agent.get_agent_metadata())
        except Exception as e:
            raise TransferError(
                f"NIXL cannot register {nbytes} bytes of {self._mem_type}: {e}"
            ) from e
        self._scratch = scratch

    def _metadata(self) -> bytes:
        return self._md

    def _do_read(
        self, remote: RemoteKV, runs: list[tuple[int, int, int]], notif: bytes, timeout_s: float
    ) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._read_locked(remote, runs, notif, deadline, timeout_s)

    def _read_locked(
        self,
        remote: RemoteKV,
        runs: list[tuple[int, int, int]],
        notif: bytes,
        deadline: float,
        timeout_s: float,
    ) -> None:
        agent = self._require_agent()
        if not runs and not notif:
            return
        peer = self._ensure_peer(remote)
        if runs:
            local_descs, remote_descs = self._descriptors(remote, runs)
        else:
            # Nothing to read but the owner must hear from us. A bare send_notif is not
            # tracked: on a new connection it waits for this agent's next progress, which may
            # never come. Instead read a few bytes of the owner's block 0 (always registered)
            # into scratch, so that the notif travels with a transfer we wait for.
            nbytes = min(_SCRATCH_BYTES, remote.block_bytes)
            local_descs = np.array(
                [(self._scratch.data_ptr(), nbytes, self._dev_id)], dtype=np.uint64
            )
            remote_descs = np.array(
                [(remote.base_addr, nbytes, remote.layout.device_id)], dtype=np.uint64
            )
        self._xfer_read(agent, peer, remote, local_descs, remote_descs, notif, deadline, timeout_s)

    def _xfer_read(
        self,
        agent: Any,
        peer: str,
        remote: RemoteKV,
        local_descs: np.ndarray,
        remote_descs: np.ndarray,
        notif: bytes,
        deadline: float,
        timeout_s: float,
    ) -> None:
        """One READ of `remote_descs` into `local_descs` (rows: address, bytes, device), with
        `notif` for the owner, waited for. A failure drops the peer (its next use reconnects)
        and raises TransferError. Caller holds the lock."""
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local_descs, self._mem_type),
                agent.get_xfer_descs(remote_descs, remote.layout.memory_type),
                peer,
                notif,
            )
        except Exception as e:
            # Typically the peer died (disconnected) or the blocks are outside its registration.
            self._drop_peer(peer)
            raise TransferError(f"cannot create a read from agent {peer!r}: {e}") from e
        try:
            self._wait(handle, peer, deadline, timeout_s)
        except TransferError:
            self._drop_peer(peer)
            raise
        finally:
            self._release(handle)

    def _do_close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        agent = self._agent
        if agent is None:
            return
        for name in list(self._peers):
            self._drop_peer(name)
        for reg in (self._staging_reg, self._reg):
            if reg is None:
                continue
            try:
                agent.deregister_memory(reg)
            except Exception as e:  # closing anyway; the agent's destructor cleans up
                logger.warning("NIXL deregistration failed for %r: %s", self.agent_name, e)
        self._reg = self._staging_reg = None
        self._agent = None  # the native agent is destroyed with its last reference

    # -------------------------------------------------------------------------------- helpers

    def _require_agent(self) -> nixl_agent:
        self._check_open()
        assert self._agent is not None  # cleared only by close(), which _check_open rejects
        return self._agent

    def _ensure_peer(self, remote: RemoteKV) -> str:
        """Load the owner's metadata unless the same metadata is already loaded."""
        name = remote.agent_name
        known = self._peers.get(name)
        if known == remote.agent_metadata:
            return name
        if known is not None:
            # Same name, new metadata: the owner restarted. Unload the dead incarnation first;
            # NIXL keys remote agents by name.
            self._drop_peer(name)
        agent = self._require_agent()
        try:
            loaded = agent.add_remote_agent(remote.agent_metadata)
        except Exception as e:
            raise TransferError(f"cannot load metadata of agent {name!r}: {e}") from e
        # The binding returns the name as bytes although it is annotated str.
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != name:
            try:
                agent.remove_remote_agent(loaded_name)
            except Exception:
                logger.debug("could not unload mismatched agent %r", loaded_name, exc_info=True)
            raise TransferError(
                f"handle names agent {name!r} but its metadata belongs to {loaded_name!r}"
            )
        self._peers[name] = remote.agent_metadata
        return name

    def _drop_peer(self, name: str) -> None:
        if self._peers.pop(name, None) is None or self._agent is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            # A dead peer may already be half torn down; the cache entry is gone either way.
            logger.debug("unloading agent %r failed", name, exc_info=True)

    def _descriptors(
        self, remote: RemoteKV, runs: list[tuple[int, int, int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(address, length, device) rows, one per run, for the local and the remote side
        (the remote device from the handle's layout: the owner's cache, not ours)."""
        r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        bb = self._block_bytes
        local = np.empty((len(runs), 3), dtype=np.uint64)
        local[:, 0] = self.base_addr + r[:, 1] * bb
        local[:, 1] = r[:, 2] * bb
        local[:, 2] = self._dev_id
        rem = np.empty_like(local)
        rem[:, 0] = remote.base_addr + r[:, 0] * bb
        rem[:, 1] = local[:, 1]
        rem[:, 2] = remote.layout.device_id  # 0 for DRAM
        return local, rem

    def _wait(self, handle: nixl_xfer_handle, peer: str, deadline: float, timeout_s: float) -> None:
        """Post the transfer and drive it to DONE; TransferError on ERR or at `deadline`."""
        agent = self._require_agent()
        try:
            started = time.monotonic()
            state = agent.transfer(handle)
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(
                        f"read from agent {peer!r} timed out after {timeout_s:g}s (is the owner "
                        "alive and calling poll()?)"
                    )
                time.sleep(poll_pause_s(now - started))
                state = agent.check_xfer_state(handle)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"read from agent {peer!r} failed: {e}") from e
        if state != "DONE":
            raise TransferError(f"read from agent {peer!r} failed (state {state})")

    def _release(self, handle: nixl_xfer_handle) -> None:
        agent = self._agent
        if agent is None:
            return
        try:
            # Cancels a read that is still in flight (timeout).
            agent.release_xfer_handle(handle)
        except Exception:
            # NIXL keeps an uncancellable handle on its leak list and frees it with the agent.
            logger.warning("NIXL could not release a transfer handle", exc_info=True)
