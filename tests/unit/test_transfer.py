"""KV transfer: `coalesce`, `RemoteKV`, and one contract suite run against every transport.

For "nixl" the owner is a real separate process (spawned once per module: start-up costs
seconds) that registers a KV cache with known contents, answers export/notif requests over a
pipe and otherwise keeps calling `poll()` so that reads make progress. For "local" the owner is
another `LocalTransport` in this process. Every read checks the copied bytes with torch.equal.
The owner also exports from caches of other layouts (dtype, block geometry), which a reader
must refuse before it moves any byte.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from tandem.services.common.runtime.process import configure_native_libraries
from tandem.transfer import (
    KVLayout,
    KVTransport,
    LayoutMismatch,
    LocalTransport,
    RemoteKV,
    TransferError,
    coalesce,
    make_transport,
)
from tandem.transfer.nixl import UCX_ENV_DEFAULTS, ucx_env_defaults

# As a service does at start-up, before any NIXL agent exists: the UCX settings the transport
# is tuned for, inherited by the owner processes; they import this module again (spawn), which
# quiets NIXL's logger there too.
configure_native_libraries()

# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: 256 floats = 1 KiB per block
BLOCK_SHAPE = (2, 2, 4, 2, 8)
OWNER_BLOCKS = 48
READER_BLOCKS = 32
OWNER_NAME = "test-owner"
BLOCK_BYTES = 4 * 2 * 2 * 4 * 2 * 8
# What every cache of the suite is, owner's and reader's: float32 in DRAM.
LAYOUT = KVLayout("DRAM", 0, "float32", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
OTHER_BLOCKS = 8


def owner_cache(generation: int) -> torch.Tensor:
    """Every element distinct, and distinct across owner incarnations (exact in float32)."""
    numel = OWNER_BLOCKS * BLOCK_BYTES // 4
    kv = torch.arange(numel, dtype=torch.float32) + generation * 1_000_000
    return kv.reshape(OWNER_BLOCKS, *BLOCK_SHAPE)


def other_cache(dtype: str, block_shape: tuple[int, ...]) -> torch.Tensor:
    """An owner cache of another layout; all sevens, so that a copy of it would show."""
    return torch.full((OTHER_BLOCKS, *block_shape), 7, dtype=getattr(torch, dtype))


def other_scales(dtype: str, block_shape: tuple[int, ...]) -> tuple[tuple[float, ...], ...]:
    """An fp8 cache's manifest (k_scales, v_scales, one per layer); none for other dtypes."""
    if dtype != "float8_e4m3fn":
        return ((), ())
    return ((0.5,) * block_shape[0], (0.25,) * block_shape[0])


# ------------------------------------------------------------------------------ pure functions


def test_coalesce_empty_and_single() -> None:
    assert coalesce([], []) == []
    assert coalesce([7], [3]) == [(7, 3, 1)]


def test_coalesce_runs_need_both_sides_consecutive() -> None:
    assert coalesce([4, 5, 6, 7], [10, 11, 12, 13]) == [(4, 10, 4)]
    # remote consecutive, local not
    assert coalesce([4, 5, 6], [10, 12, 13]) == [(4, 10, 1), (5, 12, 2)]
    # local consecutive, remote not
    assert coalesce([4, 9, 10], [0, 1, 2]) == [(4, 0, 1), (9, 1, 2)]
    # descending is not a run; repeats of a remote block are allowed
    assert coalesce([3, 2, 2], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (2, 2, 1)]
    assert coalesce([1, 2, 8, 9, 10, 4], [5, 6, 0, 1, 2, 3]) == [(1, 5, 2), (8, 0, 3), (4, 3, 1)]


def test_coalesce_reproduces_random_mappings() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        start = rng.randint(0, 5)
        remote = [start + i if rng.random() < 0.7 else rng.randint(0, 99) for i in range(n)]
        local = rng.sample(range(100), n) if rng.random() < 0.5 else list(range(5, 5 + n))
        runs = coalesce(remote, local)
        expanded = [(r + k, loc + k) for r, loc, m in runs for k in range(m)]
        assert expanded == list(zip(remote, local, strict=True))
        # maximal: adjacent runs could not have been merged
        for (r0, l0, m0), (r1, l1, _) in zip(runs, runs[1:], strict=False):
            assert not (r1 == r0 + m0 and l1 == l0 + m0)


def test_coalesce_length_mismatch() -> None:
    with pytest.raises(ValueError, match="3 != 2"):
        coalesce([1, 2, 3], [1, 2])


def test_remote_kv_validates_and_freezes() -> None:
    rkv = RemoteKV("local", "a", b"md", 4096, BLOCK_BYTES, [3, 1], LAYOUT)  # type: ignore[arg-type]
    assert rkv.block_ids == (3, 1) and rkv.num_bytes == 2 * BLOCK_BYTES
    with pytest.raises(dataclasses.FrozenInstanceError):
        rkv.block_ids = (1,)  # type: ignore[misc]
    with pytest.raises(ValueError, match="transport"):
        RemoteKV("rdma", "a", b"", 0, BLOCK_BYTES, (), LAYOUT)
    with pytest.raises(ValueError, match="block_ids"):
        RemoteKV("nixl", "a", b"", 0, BLOCK_BYTES, (1, -2), LAYOUT)
    with pytest.raises(ValueError, match="block_bytes"):
        RemoteKV("nixl", "a", b"", 0, 0, (), LAYOUT)
    with pytest.raises(ValueError, match="agent_name"):
        RemoteKV("nixl", "", b"", 0, BLOCK_BYTES, (), LAYOUT)
    # block_bytes is derived from the layout, so a handle cannot claim other bytes per block
    with pytest.raises(ValueError, match="block_bytes 2048 does not match .* 1024 bytes"):
        RemoteKV("nixl", "a", b"", 0, 2 * BLOCK_BYTES, (), LAYOUT)
    with pytest.raises(ValueError, match="layout must be a KVLayout"):
        RemoteKV("nixl", "a", b"", 0, BLOCK_BYTES, (), None)  # type: ignore[arg-type]


def test_make_transport_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="'rdma'"):
        make_transport("rdma", "x")
    with pytest.raises(ValueError, match="agent_name"):
        make_transport("local", "")


def test_configure_native_libraries_keeps_what_is_set() -> None:
    assert UCX_ENV_DEFAULTS  # else this test checks nothing
    nixl_logger = logging.getLogger("nixl")
    saved_level = nixl_logger.level
    try:
        nixl_logger.setLevel(logging.INFO)  # what importing nixl sets
        environ = {"NIXL_LOG_LEVEL": "DEBUG"}
        configure_native_libraries(environ)
        assert environ == {"NIXL_LOG_LEVEL": "DEBUG", **UCX_ENV_DEFAULTS}
        assert nixl_logger.level == logging.INFO  # NIXL applies the level the user asked for

        overridden = {key: "1m" for key in UCX_ENV_DEFAULTS}
        configure_native_libraries(overridden)
        assert overridden == {key: "1m" for key in UCX_ENV_DEFAULTS}
        assert nixl_logger.level == logging.WARNING
    finally:
        nixl_logger.setLevel(saved_level)


def test_cuda_workers_get_cuda_ipc_reads() -> None:
    # A GET of VRAM without this falls back to TCP emulation on a GPU without NVLink peers
    # (0.5 GB/s measured on an H200); a CPU process's UCX would warn it is unused.
    environ: dict[str, str] = {}
    configure_native_libraries(environ, device="cuda:1")
    assert environ == {**UCX_ENV_DEFAULTS, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert ucx_env_defaults("cpu") == UCX_ENV_DEFAULTS
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in ucx_env_defaults("cpu")


# -------------------------------------------------------------------------------- owner side


def _owner_main(conn: Connection, agent_name: str, generation: int) -> None:
    """Owner process: register a known cache, serve requests, and poll() in between."""
    transport = make_transport("nixl", agent_name)
    transport.register(owner_cache(generation))
    conn.send("ready")
    notifs: list[bytes] = []
    others: dict[str, KVTransport] = {}  # agents over caches of other layouts, by name
    while True:
        for t in (transport, *others.values()):
            notifs.extend(t.poll())
        try:
            if not conn.poll(0.0005):
                continue
            cmd, arg = conn.recv()
        except (EOFError, OSError):  # the test process went away
            break
        if cmd == "export":
            conn.send(transport.export(arg))
        elif cmd == "export_other":
            dtype, block_shape, block_ids = arg
            name = other_name(dtype, block_shape)
            if name not in others:
                others[name] = make_transport("nixl", name)
                others[name].register(
                    other_cache(dtype, block_shape), other_scales(dtype, block_shape)
                )
            conn.send(others[name].export(block_ids))
        elif cmd == "notifs":
            conn.send(notifs)
            notifs = []
        elif cmd == "stop":
            break
    for t in (transport, *others.values()):
        t.close()


def other_name(dtype: str, block_shape: tuple[int, ...]) -> str:
    return f"{OWNER_NAME}-{dtype}-{'x'.join(map(str, block_shape))}"


class Owner:
    """The owner side of the suite; subclasses differ only in where the owner lives."""

    kind = ""

    def __init__(self) -> None:
        self.generation = 0
        self._pending: list[bytes] = []

    def expected(self, block_ids: Sequence[int]) -> torch.Tensor:
        return owner_cache(self.generation)[list(block_ids)]

    def wait_notif(self, msg: bytes, timeout_s: float = 10.0) -> None:
        """Wait until the owner's poll() has returned `msg` (then consume it)."""
        deadline = time.monotonic() + timeout_s
        while msg not in self._pending:
            assert time.monotonic() < deadline, f"owner never saw {msg!r}: {self._pending}"
            self._pending.extend(self._fetch_notifs())
            time.sleep(0.001)
        self._pending.remove(msg)

    def export(self, block_ids: Sequence[int]) -> RemoteKV:
        raise NotImplementedError

    def export_other(
        self, dtype: str, block_shape: tuple[int, ...], block_ids: Sequence[int]
    ) -> RemoteKV:
        """Export blocks of another cache of the owner's, of `dtype` and `block_shape`."""
        raise NotImplementedError

    def _fetch_notifs(self) -> list[bytes]:
        raise NotImplementedError

    def start(self) -> None:
        """Start a (new) incarnation under the same agent name, with new contents."""
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError


class LocalOwner(Owner):
    kind = "local"

    def __init__(self) -> None:
        super().__init__()
        self.transport: LocalTransport | None = None
        self.others: dict[str, LocalTransport] = {}

    def start(self) -> None:
        self.generation += 1
        self._pending = []
        self.transport = LocalTransport(OWNER_NAME)
        self.transport.register(owner_cache(self.generation))

    def export(self, block_ids: Sequence[int]) -> RemoteKV:
        assert self.transport is not None
        return self.transport.export(block_ids)

    def export_other(
        self, dtype: str, block_shape: tuple[int, ...], block_ids: Sequence[int]
    ) -> RemoteKV:
        name = other_name(dtype, block_shape)
        if name not in self.others:
            self.others[name] = LocalTransport(name)
            self.others[name].register(
                other_cache(dtype, block_shape), other_scales(dtype, block_shape)
            )
        return self.others[name].export(block_ids)

    def _fetch_notifs(self) -> list[bytes]:
        assert self.transport is not None
        return [n for t in (self.transport, *self.others.values()) for n in t.poll()]

    def kill(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport = None
        for t in self.others.values():
            t.close()
        self.others = {}

    @property
    def alive(self) -> bool:
        return self.transport is not None


class NixlOwner(Owner):
    kind = "nixl"

    def __init__(self) -> None:
        super().__init__()
        self.proc: Any = None
        self.conn: Connection | None = None

    def start(self) -> None:
        self.generation += 1
        self._pending = []
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_owner_main, args=(child, OWNER_NAME, self.generation), daemon=True
        )
        self.proc.start()
        child.close()
        self.conn = parent
        assert parent.poll(60), "owner process did not start"
        assert parent.recv() == "ready"

    def _call(self, cmd: str, arg: Any = None) -> Any:
        assert self.conn is not None
        self.conn.send((cmd, arg))
        assert self.conn.poll(10), f"owner did not answer {cmd!r}"
        return self.conn.recv()

    def export(self, block_ids: Sequence[int]) -> RemoteKV:
        remote = self._call("export", list(block_ids))
        assert isinstance(remote, RemoteKV)
        return remote

    def export_other(
        self, dtype: str, block_shape: tuple[int, ...], block_ids: Sequence[int]
    ) -> RemoteKV:
        remote = self._call("export_other", (dtype, block_shape, list(block_ids)))
        assert isinstance(remote, RemoteKV)
        return remote

    def _fetch_notifs(self) -> list[bytes]:
        notifs = self._call("notifs")
        assert isinstance(notifs, list)
        return notifs

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
        self.proc = None
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def stop(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.is_alive():
            self.conn.send(("stop", None))
            self.proc.join(10)
        self.kill()

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()


@dataclasses.dataclass
class Pair:
    kind: str
    owner: Owner
    reader: KVTransport

    def read(self, remote: RemoteKV, local_ids: Sequence[int], **kw: Any) -> int:
        return self.reader.read(remote, local_ids, **kw)

    def assert_copied(self, remote_ids: Sequence[int], local_ids: Sequence[int]) -> None:
        got = self.reader.kv_cache[list(local_ids)]
        assert torch.equal(got, self.owner.expected(remote_ids))

    def assert_untouched(self, local_ids: Sequence[int]) -> None:
        assert torch.count_nonzero(self.reader.kv_cache[list(local_ids)]) == 0


@pytest.fixture(scope="module", params=["local", "nixl"])
def module_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    kind = request.param
    owner: Owner = LocalOwner() if kind == "local" else NixlOwner()
    owner.start()
    reader = make_transport(kind, "test-reader")
    reader.register(torch.zeros(READER_BLOCKS, *BLOCK_SHAPE))
    try:
        yield Pair(kind, owner, reader)
    finally:
        reader.close()
        if isinstance(owner, NixlOwner):
            owner.stop()
        else:
            owner.kill()


@pytest.fixture
def pair(module_pair: Pair) -> Pair:
    """The module's pair with a live owner and a zeroed reader cache."""
    if not module_pair.owner.alive:
        module_pair.owner.start()
    module_pair.reader.kv_cache.zero_()
    return module_pair


# ------------------------------------------------------------------------------ the contract


def test_single_block(pair: Pair) -> None:
    remote = pair.owner.export([5])
    assert remote.transport == pair.kind and remote.block_bytes == BLOCK_BYTES
    assert remote.layout == pair.reader.layout == LAYOUT
    assert pair.read(remote, [9]) == BLOCK_BYTES
    assert pair.reader.last_num_descriptors == 1
    pair.assert_copied([5], [9])
    pair.assert_untouched([i for i in range(READER_BLOCKS) if i != 9])


def test_many_scattered_blocks(pair: Pair) -> None:
    rng = random.Random(1)
    remote_ids = rng.sample(range(OWNER_BLOCKS), 24)
    local_ids = rng.sample(range(READER_BLOCKS), 24)
    moved = pair.read(pair.owner.export(remote_ids), local_ids)
    assert moved == 24 * BLOCK_BYTES
    assert pair.reader.last_num_descriptors == len(coalesce(remote_ids, local_ids))
    pair.assert_copied(remote_ids, local_ids)


def test_contiguous_runs_are_coalesced(pair: Pair) -> None:
    remote_ids = [10, 11, 12, 13, 30, 31, 5]
    local_ids = [0, 1, 2, 3, 4, 5, 20]
    pair.read(pair.owner.export(remote_ids), local_ids)
    assert pair.reader.last_num_descriptors == 3
    pair.assert_copied(remote_ids, local_ids)
    # a whole prompt in consecutive blocks on both sides is a single descriptor
    pair.read(pair.owner.export(range(16, 48)), range(32))
    assert pair.reader.last_num_descriptors == 1
    pair.assert_copied(range(16, 48), range(32))


def test_partial_read_of_a_subset(pair: Pair) -> None:
    remote = pair.owner.export([40, 2, 3, 4, 17, 18])
    # e.g. the reader already has the first two blocks from its prefix cache
    subset = dataclasses.replace(remote, block_ids=remote.block_ids[2:5])
    assert pair.read(subset, [7, 8, 9]) == 3 * BLOCK_BYTES
    pair.assert_copied([3, 4, 17], [7, 8, 9])
    pair.assert_untouched([i for i in range(READER_BLOCKS) if i not in (7, 8, 9)])


def test_notif_delivered_to_owner_poll(pair: Pair) -> None:
    pair.read(pair.owner.export([1, 2]), [3, 4], notif=b"req-42")
    pair.owner.wait_notif(b"req-42")
    pair.assert_copied([1, 2], [3, 4])
    # With nothing to read the owner still learns that the reader is done, even over a new
    # connection and with the reader idle afterwards.
    pair.reader.forget_peer(OWNER_NAME)
    assert pair.read(pair.owner.export([]), [], notif=b"req-43") == 0
    assert pair.reader.last_num_descriptors == 0
    pair.owner.wait_notif(b"req-43")
    pair.assert_untouched([i for i in range(READER_BLOCKS) if i not in (3, 4)])


def test_poll_from_another_thread_while_reading(pair: Pair) -> None:
    # The worker layout: a progress thread polls while other threads export and read.
    stop = threading.Event()
    errors: list[BaseException] = []

    def progress() -> None:
        try:
            while not stop.is_set():
                pair.reader.poll()
        except BaseException as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=progress)
    thread.start()
    try:
        for i in range(20):
            remote_ids = [(i + k) % OWNER_BLOCKS for k in range(4)]
            pair.read(pair.owner.export(remote_ids), [i, i + 4, i + 8, i + 12])
            pair.assert_copied(remote_ids, [i, i + 4, i + 8, i + 12])
    finally:
        stop.set()
        thread.join(10)
    assert not errors


def test_misuse_raises_value_error(pair: Pair) -> None:
    remote = pair.owner.export([1, 2, 3])
    with pytest.raises(ValueError, match="3"):
        pair.read(remote, [0, 1])
    with pytest.raises(ValueError, match="out of range"):
        pair.read(remote, [0, 1, READER_BLOCKS])
    with pytest.raises(ValueError, match="repeated"):
        pair.read(remote, [0, 1, 0])
    with pytest.raises(ValueError, match="timeout_s"):
        pair.read(remote, [0, 1, 2], timeout_s=0)
    with pytest.raises(ValueError, match="block_bytes"):
        pair.read(dataclasses.replace(remote, block_bytes=BLOCK_BYTES * 2), [0, 1, 2])
    other = "nixl" if pair.kind == "local" else "local"
    with pytest.raises(ValueError, match=other):
        pair.read(dataclasses.replace(remote, transport=other), [0, 1, 2])
    with pytest.raises(ValueError, match="out of range"):
        pair.owner.export([OWNER_BLOCKS]) if pair.kind == "local" else pair.reader.export([99])
    with pytest.raises(ValueError, match="already"):
        pair.reader.register(torch.zeros(4, *BLOCK_SHAPE))
    pair.assert_untouched(range(READER_BLOCKS))


def test_register_rejects_non_contiguous(pair: Pair) -> None:
    transport = make_transport(pair.kind, "test-scratch")
    try:
        kv = torch.zeros(*BLOCK_SHAPE, 8).movedim(-1, 0)  # block-major view of another layout
        assert not kv.is_contiguous()
        with pytest.raises(ValueError, match="contiguous"):
            transport.register(kv)
        with pytest.raises(RuntimeError, match="register"):
            transport.export([0])
        # not the engine cache's [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        with pytest.raises(ValueError, match=r"shape \[num_blocks, num_layers, 2, .*\(8, 512\)"):
            transport.register(torch.zeros(8, 512))
        with pytest.raises(ValueError, match=r"got \(8, 2, 3, 4, 2, 8\)"):
            transport.register(torch.zeros(8, 2, 3, 4, 2, 8))
        transport.register(kv.contiguous())  # a failed register can be retried
        assert transport.layout == LAYOUT
    finally:
        transport.close()
    with pytest.raises(RuntimeError, match="closed"):
        transport.poll()


@pytest.mark.parametrize(
    "dtype, block_shape, diffs",
    [
        ("bfloat16", BLOCK_SHAPE, {"dtype": ("bfloat16", "float32")}),
        # As many bytes per block as the reader's: only the layout tells the caches apart.
        ("float32", (1, 2, 8, 2, 8), {"num_layers": (1, 2), "block_size": (8, 4)}),
        # An fp8 cache and its manifest (issue 28): both named.
        (
            "float8_e4m3fn",
            BLOCK_SHAPE,
            {
                "dtype": ("float8_e4m3fn", "float32"),
                "k_scales": ((0.5, 0.5), ()),
                "v_scales": ((0.25, 0.25), ()),
            },
        ),
    ],
    ids=["dtype", "block-geometry", "fp8-kv-format"],
)
def test_incompatible_layout_is_refused_before_reading(
    pair: Pair, dtype: str, block_shape: tuple[int, ...], diffs: dict[str, tuple[Any, Any]]
) -> None:
    remote = pair.owner.export_other(dtype, block_shape, [0, 1, 2])
    num_layers, _, block_size, num_kv_heads, head_dim = block_shape
    k_scales, v_scales = other_scales(dtype, block_shape)
    assert remote.layout == KVLayout(
        "DRAM", 0, dtype, num_layers, block_size, num_kv_heads, head_dim,
        k_scales=k_scales, v_scales=v_scales,
    )  # fmt: skip
    with pytest.raises(LayoutMismatch) as refused:
        pair.read(remote, [3, 4, 5], notif=b"refused")
    assert {name: (theirs, ours) for name, theirs, ours in refused.value.diffs} == diffs
    parts = [
        f"{name}: handle has {theirs}, this worker {ours}" for name, (theirs, ours) in diffs.items()
    ]
    assert str(refused.value) == "KV layout mismatch: " + "; ".join(parts)
    pair.assert_untouched(range(READER_BLOCKS))
    if pair.kind == "nixl":
        assert remote.agent_name not in pair.reader.peers  # type: ignore[attr-defined]
    # the reader still reads compatible handles
    pair.read(pair.owner.export([1, 2, 3]), [3, 4, 5])
    pair.assert_copied([1, 2, 3], [3, 4, 5])


def test_remote_blocks_outside_registration(pair: Pair) -> None:
    remote = pair.owner.export([0])
    forged = dataclasses.replace(remote, block_ids=(OWNER_BLOCKS + 100,))
    with pytest.raises(TransferError):
        pair.read(forged, [0], timeout_s=5)
    # the reader recovers: the next good read works
    pair.read(remote, [0])
    pair.assert_copied([0], [0])


@pytest.mark.deadline
def test_unknown_peer(pair: Pair) -> None:
    remote = pair.owner.export([0])
    bogus = dataclasses.replace(remote, agent_name="nobody", agent_metadata=b"junk")
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        pair.read(bogus, [0], timeout_s=3)
    assert time.monotonic() - t0 < 3.5
    pair.assert_untouched([0])


@pytest.mark.deadline
def test_frozen_owner_times_out(pair: Pair) -> None:
    if not isinstance(pair.owner, NixlOwner):
        pytest.skip("local reads are synchronous: an owner cannot stall them")
    remote = pair.owner.export([6, 7])
    # Connecting needs the owner's progress, so a read that has to (re)connect to a frozen
    # owner cannot complete. (Over an established connection, small reads need none.)
    pair.reader.forget_peer(OWNER_NAME)
    pair.owner.freeze()
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="timed out"):
            pair.read(remote, [0, 1], notif=b"frozen", timeout_s=1.0)
        assert 1.0 <= time.monotonic() - t0 < 3.0
    finally:
        pair.owner.thaw()
    pair.reader.kv_cache.zero_()
    pair.read(remote, [2, 3], notif=b"thawed")
    pair.owner.wait_notif(b"thawed")
    pair.assert_copied([6, 7], [2, 3])


@pytest.mark.deadline
def test_dead_owner_then_restart(pair: Pair) -> None:
    stale = pair.owner.export([3, 4])
    pair.read(stale, [0, 1])
    pair.owner.kill()
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        pair.read(stale, [0, 1], timeout_s=5)
    assert time.monotonic() - t0 < 5.5, "a dead owner must fail within the timeout"

    # Same agent name, new metadata and contents: picked up from the handle automatically.
    pair.owner.start()
    fresh = pair.owner.export([3, 4])
    assert fresh.agent_metadata != stale.agent_metadata
    pair.reader.kv_cache.zero_()
    pair.read(fresh, [0, 1], notif=b"after-restart")
    pair.owner.wait_notif(b"after-restart")
    pair.assert_copied([3, 4], [0, 1])

    # A handle from the dead incarnation stays an error, and does not break the fresh one.
    with pytest.raises(TransferError):
        pair.read(stale, [5, 6], timeout_s=2)
    pair.read(fresh, [5, 6])
    pair.assert_copied([3, 4], [5, 6])


def test_forget_peer_then_read(pair: Pair) -> None:
    pair.read(pair.owner.export([8]), [0])
    pair.owner.kill()
    pair.owner.start()
    pair.reader.forget_peer(OWNER_NAME)
    pair.reader.forget_peer("never-seen")  # unknown names are ignored
    pair.reader.kv_cache.zero_()
    pair.read(pair.owner.export([8, 9]), [0, 1], notif=b"forgot")
    pair.owner.wait_notif(b"forgot")
    pair.assert_copied([8, 9], [0, 1])
