"""tandem.tiers: records that bind bytes to their identity, the host and disk stores, the tier
threads (push-back, verification on read-back, warm restarts) and the index's tier marks."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem.engine.block_pool import KVEvent, KVEventKind
from tandem.engine.prefix_hash import DISK_TIER, HOST_TIER, tier_mark
from tandem.tiers import record
from tandem.tiers.cache import TierCache
from tandem.tiers.marks import DEVICE, TierMarks
from tandem.tiers.stores import DiskStore, HostEntry, HostStore

IDENT = record.identity({"model": "m", "dtype": "torch.float32", "layout": "slots2"})
OTHER = record.identity({"model": "m", "dtype": "torch.bfloat16", "layout": "slots2"})
BLOCK = 256


def payload(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=g)


def view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())  # type: ignore[arg-type]


# -- records ---------------------------------------------------------------------------------


def test_a_record_is_served_only_with_its_identity_key_length_and_bytes() -> None:
    data = payload(1)
    header = record.seal(IDENT, 7, record.FLAG_PUBLISHED, view(data))
    parsed = record.parse_header(header.pack())
    assert parsed == header and len(header.pack()) == record.HEADER_BYTES
    assert record.check(parsed, IDENT, view(data), 7) == ""
    assert "another model" in record.check(parsed, OTHER, view(data), 7)
    assert "not 0000000000000008" in record.check(parsed, IDENT, view(data), 8)
    assert "truncated" in record.check(parsed, IDENT, view(data)[:-1], 7)
    flipped = data.clone()
    flipped[100] ^= 1
    assert "digest" in record.check(parsed, IDENT, view(flipped), 7)
    # the flags are bound too: a record cannot be re-published under the same bytes
    assert record.digest(IDENT, 7, 0, view(data)) != header.digest
    assert record.parse_header(b"x" * record.HEADER_BYTES) is None
    assert record.parse_header(header.pack()[:-1]) is None


def test_identity_covers_every_field_and_the_format_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fields = {"model": "m", "kv_format": "fp8/00ff"}
    base = record.identity(fields)
    assert record.identity(dict(fields)) == base
    assert record.identity({**fields, "kv_format": "fp8/00fe"}) != base
    monkeypatch.setattr(record, "FORMAT_VERSION", record.FORMAT_VERSION + 1)
    assert record.identity(fields) != base


# -- stores ----------------------------------------------------------------------------------


def entry(seed: int) -> HostEntry:
    data = payload(seed)
    return HostEntry(data, 0, record.digest(IDENT, seed, 0, view(data)))


def test_host_store_evicts_least_recently_used_within_its_budget() -> None:
    size = BLOCK + 16  # payload + digest
    store = HostStore(3 * size)
    for key in (1, 2, 3):
        assert store.put(key, entry(key)) == []
    assert store.get(1) is not None  # 1 is now the most recent
    assert store.put(4, entry(4)) == [2]
    assert sorted(store.keys()) == [1, 3, 4] and store.used == 3 * size
    assert store.put(4, entry(4)) == []  # already held
    assert HostStore(size - 1).put(1, entry(1)) is None  # can never fit
    assert store.drop(3) and not store.drop(3) and store.used == 2 * size


def seal(key: int, data: torch.Tensor, flags: int = 0) -> record.Header:
    return record.seal(IDENT, key, flags, view(data))


def test_disk_store_writes_reads_evicts_and_is_one_workers(tmp_path: Path) -> None:
    size = record.HEADER_BYTES + BLOCK
    store = DiskStore(str(tmp_path), 2 * size, IDENT)
    for key in (1, 2):
        assert store.put(key, seal(key, payload(key)), view(payload(key))) == []
    data, flags, why = store.read(1)
    assert why == "" and torch.equal(data, payload(1)) and flags == 0
    assert store.put(3, seal(3, payload(3), 1), view(payload(3))) == [2]  # 1 was read last
    assert not store.path(2).exists() and store.used == 2 * size
    assert sorted(k for k, _ in store.held()) == [1, 3] and dict(store.held())[3] == 1
    with pytest.raises(ValueError, match="in use by another worker"):
        DiskStore(str(tmp_path), size, IDENT)
    store.close()
    DiskStore(str(tmp_path), size, IDENT).close()  # the lock went with the first


def test_a_failed_disk_write_leaves_nothing_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(str(tmp_path), 10 * BLOCK, IDENT)

    def fail(path: Path, header: bytes, data: memoryview) -> None:
        path.write_bytes(header)  # part of it landed
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_write", fail)
    with pytest.raises(OSError):
        store.put(5, seal(5, payload(5)), view(payload(5)))
    assert 5 not in store and store.used == 0 and not list(tmp_path.glob("*.kv"))
    assert not list(tmp_path.glob(".*.tmp"))
    store.close()


def test_a_restarted_disk_store_admits_only_good_records_of_its_identity(tmp_path: Path) -> None:
    size = record.HEADER_BYTES + BLOCK
    store = DiskStore(str(tmp_path), 10 * size, IDENT)
    for key in range(1, 6):
        store.put(key, seal(key, payload(key), record.FLAG_PUBLISHED), view(payload(key)))
    store.close()
    raw = bytearray(store.path(2).read_bytes())
    raw[record.HEADER_BYTES + 10] ^= 0x40  # a flipped bit
    store.path(2).write_bytes(raw)
    store.path(3).write_bytes(store.path(3).read_bytes()[:-7])  # truncated
    os.replace(store.path(4), store.path(9))  # renamed to another block's name
    (tmp_path / ".0000000000000001.77.tmp").write_bytes(b"half")  # an interrupted write
    foreign = DiskStore(str(tmp_path / "other"), 10 * size, OTHER)
    foreign.put(6, record.seal(OTHER, 6, 0, view(payload(6))), view(payload(6)))
    foreign.close()
    os.replace(foreign.path(6), store.path(6))

    again = DiskStore(str(tmp_path), 10 * size, IDENT)
    scanned = {key: why for key, _, why in again.scan()}
    assert scanned[1] == "" and scanned[5] == ""
    assert (
        "digest" in scanned[2]
        and "truncated" in scanned[3]
        and "not 0000000000000009" in scanned[9]
    )
    assert 6 not in scanned and again.path(6).exists()  # another identity's: left alone
    assert sorted(k for k, _ in again.held()) == [1, 5]
    assert dict(again.held())[1] == record.FLAG_PUBLISHED
    assert not list(tmp_path.glob(".*.tmp")) and not again.path(2).exists()
    again.close()


# -- the tier threads ------------------------------------------------------------------------


def both_tiers(tmp_path: Path) -> TierCache:
    """Host and disk tiers of 100 blocks each, keeping their changes for `take_changes`."""
    tiers = TierCache(IDENT, BLOCK, host_bytes=100 * BLOCK, disk_dir=str(tmp_path),
                      disk_bytes=100 * BLOCK)  # fmt: skip
    tiers.record_changes = True
    return tiers


def test_offloads_become_visible_once_stored_and_come_back_verified(tmp_path: Path) -> None:
    tiers = both_tiers(tmp_path)
    try:
        assert tiers.wants(1) and tiers.tier_of(1) is None
        tiers.offer(1, record.FLAG_PUBLISHED, payload(1))
        assert tiers.drain()
        assert tiers.tier_of(1) == HOST_TIER and not tiers.wants(1)
        assert set(tiers.take_changes()) == {(1, HOST_TIER, True, 1), (1, DISK_TIER, True, 1)}
        job = tiers.onload([1])
        assert job.done.wait(5) and torch.equal(job.payloads[1], payload(1))
        assert job.flags[1] == record.FLAG_PUBLISHED
        host, disk = tiers.stats()
        assert (host.tier, host.blocks, host.onload_bytes, host.digest_mismatches) == (
            "host",
            1,
            BLOCK,
            0,
        )
        assert (disk.tier, disk.blocks, disk.offload_bytes) == ("disk", 1, BLOCK)
        assert tiers.onload_rate(HOST_TIER) > 0 and tiers.onload_rate(DISK_TIER) > 0
    finally:
        tiers.close()


def test_a_flipped_byte_in_host_memory_or_on_disk_is_a_counted_miss(tmp_path: Path) -> None:
    tiers = both_tiers(tmp_path)
    try:
        for key in (1, 2, 3):
            tiers.offer(key, 0, payload(key))
        assert tiers.drain()
        assert tiers.host is not None and tiers.disk is not None
        tiers.host.get_quiet(2).payload[5] ^= 1  # type: ignore[union-attr]  # memory corrupted
        job = tiers.onload([1, 2, 3])
        assert job.done.wait(5)
        # the bad host record is dropped and the disk's good copy serves in its place
        assert list(job.payloads) == [1, 2, 3] and job.tiers == {1: 1, 2: 2, 3: 1}
        assert torch.equal(job.payloads[2], payload(2))
        assert 2 not in tiers.host and tiers.tier_of(2) == DISK_TIER
        raw = bytearray(tiers.disk.path(2).read_bytes())
        raw[-1] ^= 0x80
        tiers.disk.path(2).write_bytes(raw)
        job = tiers.onload([2, 3])
        # no good copy left: the job stops there (a prefix ends at its first missing block)
        assert job.done.wait(5) and not job.payloads and tiers.tier_of(2) is None
        host, disk = tiers.stats()
        assert host.digest_mismatches == 1 and disk.digest_mismatches == 1
        assert (2, HOST_TIER, False, 0) in tiers.take_changes()
    finally:
        tiers.close()


def test_a_slow_disk_pushes_back_without_stalling_the_offers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    original = DiskStore._write

    def slow(path: Path, header: bytes, data: memoryview) -> None:
        release.wait(10)
        original(path, header, data)

    monkeypatch.setattr(DiskStore, "_write", staticmethod(slow))
    tiers = TierCache(IDENT, BLOCK, host_bytes=1000 * BLOCK, disk_dir=str(tmp_path),
                      disk_bytes=1000 * BLOCK, max_pending=2)  # fmt: skip
    try:
        t0 = time.perf_counter()
        for key in range(1, 21):
            if tiers.wants(key):
                tiers.offer(key, 0, payload(key))
            time.sleep(0.002)
        offering = time.perf_counter() - t0
        deadline = time.monotonic() + 5
        while sum(tiers.tier_of(k) == HOST_TIER for k in range(1, 21)) < 20:
            assert time.monotonic() < deadline, "the host tier starved behind the disk"
            time.sleep(0.01)
        release.set()
        assert tiers.drain()
        host, disk = tiers.stats()
        assert host.blocks == 20 and host.skipped_offloads == 0
        assert disk.skipped_offloads > 0 and disk.blocks == 20 - disk.skipped_offloads
        assert offering < 5  # the offers never waited for the disk (10 s)
    finally:
        release.set()
        tiers.close()


def test_a_failed_write_is_counted_and_never_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(path: Path, header: bytes, data: memoryview) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(DiskStore, "_write", staticmethod(fail))
    tiers = TierCache(IDENT, BLOCK, disk_dir=str(tmp_path), disk_bytes=100 * BLOCK)
    tiers.record_changes = True
    try:
        tiers.offer(1, 0, payload(1))
        assert tiers.drain()
        assert tiers.tier_of(1) is None and tiers.take_changes() == []
        assert tiers.stats()[0].failed_writes == 1
    finally:
        tiers.close()


def test_a_restarted_tier_serves_its_disk_records_again(tmp_path: Path) -> None:
    tiers = TierCache(IDENT, BLOCK, disk_dir=str(tmp_path), disk_bytes=100 * BLOCK)
    tiers.offer(1, record.FLAG_PUBLISHED, payload(1))
    assert tiers.drain()
    tiers.close()
    again = TierCache(IDENT, BLOCK, disk_dir=str(tmp_path), disk_bytes=100 * BLOCK)
    try:
        assert again.drain()
        assert again.tier_of(1) == DISK_TIER
        assert again.held() == [(1, DISK_TIER, record.FLAG_PUBLISHED)]
        job = again.onload([1])
        assert job.done.wait(5) and torch.equal(job.payloads[1], payload(1))
    finally:
        again.close()
    other = TierCache(OTHER, BLOCK, disk_dir=str(tmp_path), disk_bytes=100 * BLOCK)
    try:
        assert other.drain() and other.tier_of(1) is None  # another identity's: not served
    finally:
        other.close()


# -- tier marks ------------------------------------------------------------------------------


def stored(key: int, tier: int) -> KVEvent:
    return KVEvent(KVEventKind.STORED, tier_mark(key, tier))


def removed(key: int, tier: int) -> KVEvent:
    return KVEvent(KVEventKind.REMOVED, tier_mark(key, tier))


def test_tier_marks_follow_the_fastest_tier_holding_each_key() -> None:
    marks = TierMarks()
    assert marks.change(5, DEVICE, True) == [stored(5, HOST_TIER), stored(5, DISK_TIER)]
    assert marks.change(5, HOST_TIER, True) == []  # the device already counts for both
    assert marks.change(5, DEVICE, False) == []  # still in host memory
    assert marks.change(5, DISK_TIER, True) == []
    assert marks.change(5, HOST_TIER, False) == [removed(5, HOST_TIER)]  # disk only now
    assert sorted(marks.hashes()) == [tier_mark(5, DISK_TIER)]
    assert marks.change(5, DISK_TIER, False) == [removed(5, DISK_TIER)]
    assert marks.hashes() == [] and marks.change(6, HOST_TIER, False) == []
    marks.reset([(7, DISK_TIER), (8, DEVICE)])
    assert sorted(marks.hashes()) == sorted(
        [tier_mark(7, DISK_TIER), tier_mark(8, HOST_TIER), tier_mark(8, DISK_TIER)]
    )


def test_a_restart_over_budget_keeps_the_newest_records(tmp_path: Path) -> None:
    size = record.HEADER_BYTES + BLOCK
    store = DiskStore(str(tmp_path), 10 * size, IDENT)
    for key in range(1, 6):
        store.put(key, seal(key, payload(key)), view(payload(key)))
        os.utime(store.path(key), (1000 + key, 1000 + key))  # written in key order
    store.close()
    again = DiskStore(str(tmp_path), 3 * size, IDENT)
    assert [k for k, _, why in again.scan() if not why] == [5, 4, 3]
    assert not again.path(1).exists() and not again.path(2).exists()
    # the oldest admitted is the first evicted
    assert again.put(6, seal(6, payload(6)), view(payload(6))) == [3]
    again.close()


def test_changes_are_kept_only_once_someone_takes_them(tmp_path: Path) -> None:
    """A worker that never publishes to an index (no Redis, `tandem generate`) must not
    accumulate the tiers' changes forever."""
    tiers = TierCache(IDENT, BLOCK, host_bytes=100 * BLOCK)
    try:
        for key in range(1, 6):
            tiers.offer(key, 0, payload(key))
        assert tiers.drain() and tiers.take_changes() == []
        tiers.record_changes = True
        tiers.offer(6, 0, payload(6))
        assert tiers.drain() and tiers.take_changes() == [(6, HOST_TIER, True, 0)]
    finally:
        tiers.close()


def test_a_header_claiming_more_bytes_than_its_file_is_refused(tmp_path: Path) -> None:
    store = DiskStore(str(tmp_path), 10 * BLOCK + 1000, IDENT)
    store.put(1, seal(1, payload(1)), view(payload(1)))
    header = record.parse_header(store.path(1).read_bytes())
    assert header is not None
    lying = record.Header(header.ident, 1, 0, 1 << 60, header.digest).pack()
    store.path(1).write_bytes(lying + bytes(view(payload(1))))
    data, _, why = store.read(1)
    assert "truncated" in why and data.numel() == 0 and 1 not in store
    store.close()
