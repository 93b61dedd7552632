"""The tiers' storage: host memory and a disk directory, each least recently used first.

A store holds only records whose bytes and digest are complete (`put` makes a record
visible as its last act: a host entry is inserted once its digest is computed, a disk file
is renamed into place once written and flushed), so anything a lookup sees can be read; a
read that fails its check (tandem.tiers.record) drops the record and is a miss.

Both are called from the tier thread (writes, reads) and the engine thread (`in`, `keys`):
each guards its index with a lock and never holds it over I/O.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from threading import Lock

import torch

from tandem.tiers import record

log = logging.getLogger(__name__)
SUFFIX = ".kv"


@dataclass(frozen=True, slots=True)
class HostEntry:
    payload: torch.Tensor  # uint8, 1-D, on the CPU (pinned when the cache is on a GPU)
    flags: int
    digest: bytes


class HostStore:
    """Block records in host memory, within `capacity` bytes (payload + digest)."""

    name = "host"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()
        self._lock = Lock()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        with self._lock:
            return list(self._entries)

    def put(self, key: int, entry: HostEntry) -> list[int] | None:
        """Keep `entry` (visible from now on), evicting the least recently used records it
        needs room from; their keys are returned. None: it can never fit."""
        size = entry.payload.numel() + len(entry.digest)
        if size > self.capacity:
            return None
        evicted = []
        with self._lock:
            if key in self._entries:
                return []
            while self.used + size > self.capacity:
                old, gone = self._entries.popitem(last=False)
                self.used -= gone.payload.numel() + len(gone.digest)
                evicted.append(old)
            self._entries[key] = entry
            self.used += size
        return evicted

    def held(self) -> list[tuple[int, int]]:
        """(key, record flags) of every visible record (as `DiskStore.held`)."""
        with self._lock:
            return [(key, entry.flags) for key, entry in self._entries.items()]

    def get_quiet(self, key: int) -> HostEntry | None:
        """The record of `key` (not marked used); None if there is none."""
        return self._entries.get(key)

    def get(self, key: int) -> HostEntry | None:
        """The record of `key`, marked used; None if there is none."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def drop(self, key: int) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.used -= entry.payload.numel() + len(entry.digest)
            return entry is not None


class DiskStore:
    """Block records as files `<key>.kv` in one directory, within `capacity` bytes.

    The directory is this worker's alone (an exclusive lock on `.lock`: a second worker
    pointed at it fails at start, naming it). Records of another identity (another model,
    layout or format version) are left alone and not counted; `scan` re-admits this
    identity's records after verifying each (a warm restart)."""

    name = "disk"

    def __init__(self, directory: str, capacity: int, ident: bytes) -> None:
        self.dir = Path(directory)
        self.capacity = capacity
        self.ident = ident
        self.used = 0
        self._files: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> bytes, flags
        self._lock = Lock()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ValueError(
                f"the KV disk tier directory {self.dir} is in use by another worker: give "
                "each worker its own kv_disk_dir"
            ) from None
        for stale in self.dir.glob(".*.tmp"):  # writes a crash interrupted: never visible
            stale.unlink(missing_ok=True)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    def held(self) -> list[tuple[int, int]]:
        """(key, record flags) of every visible record."""
        with self._lock:
            return [(key, flags) for key, (_, flags) in self._files.items()]

    def path(self, key: int) -> Path:
        return self.dir / f"{key:016x}{SUFFIX}"

    def scan(self) -> Iterator[tuple[int, int, str]]:
        """Verify the directory's records, newest first, admitting this identity's good
        ones while the budget allows (the oldest go first when it does not, and stay the
        first evicted): yields (key, flags, "") per admitted record and (key, 0, why) per
        dropped one (corrupt, truncated: deleted). Files of another identity are skipped,
        counted in one log line."""
        files = sorted(self.dir.glob("*" + SUFFIX), key=lambda p: -p.stat().st_mtime)
        foreign = 0
        for path in files:
            try:
                key = int(path.stem, 16)
                raw = path.read_bytes()
            except (ValueError, OSError):
                continue
            header = record.parse_header(raw)
            if header is not None and header.ident != self.ident:
                foreign += 1
                continue
            why = self._check(header, memoryview(raw)[record.HEADER_BYTES :], key)
            if why:
                path.unlink(missing_ok=True)
                yield key, 0, why
                continue
            if self.used + len(raw) > self.capacity:
                path.unlink(missing_ok=True)
                continue
            assert header is not None
            with self._lock:
                self._files[key] = (len(raw), header.flags)
                self._files.move_to_end(key, last=False)  # older than those admitted so far
                self.used += len(raw)
            yield key, header.flags, ""
        if foreign:
            log.warning(
                "KV disk tier %s: ignoring %d records of another model, layout or format "
                "version", self.dir, foreign,
            )  # fmt: skip

    def put(self, key: int, header: record.Header, payload: memoryview) -> list[int] | None:
        """Write the record durably, then make it visible, evicting least recently used
        records for room (their keys returned); None: it can never fit. OSError: the write
        failed, and nothing of it is visible."""
        size = record.HEADER_BYTES + len(payload)
        if size > self.capacity:
            return None
        evicted = []
        with self._lock:
            if key in self._files:
                return []
            while self._files and self.used + size > self.capacity:
                old, (gone, _) = self._files.popitem(last=False)
                self.used -= gone
                evicted.append(old)
            self.used += size  # reserved while it is written
        for old in evicted:
            self.path(old).unlink(missing_ok=True)
        tmp = self.dir / f".{key:016x}.{os.getpid()}.tmp"
        try:
            self._write(tmp, header.pack(), payload)
            os.replace(tmp, self.path(key))
        except BaseException:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.used -= size
            raise
        with self._lock:
            self._files[key] = (size, header.flags)
        return evicted

    @staticmethod
    def _write(path: Path, header: bytes, payload: memoryview) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for chunk in (header, payload):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, key: int) -> tuple[torch.Tensor, int, str]:
        """(payload as uint8, flags, "") for a good record of `key`, marked used; (empty,
        0, why) otherwise (the record, if any, is dropped). One read into the returned
        buffer (no zero-fill, no intermediate copy); a header that claims more bytes than
        the file holds is refused before anything is allocated for it."""
        empty = torch.empty(0, dtype=torch.uint8, device="cpu")
        with self._lock:
            if key not in self._files:
                return empty, 0, "not held"
            self._files.move_to_end(key)
        try:
            with open(self.path(key), "rb", buffering=0) as f:
                header = record.parse_header(f.read(record.HEADER_BYTES))
                on_disk = os.fstat(f.fileno()).st_size - record.HEADER_BYTES
                size = min(header.payload_bytes, on_disk) if header is not None else 0
                payload = torch.empty(max(size, 0), dtype=torch.uint8, device="cpu")
                view = memoryview(payload.numpy())  # type: ignore[arg-type]
                got = 0
                while got < size and (n := f.readinto(view[got:])):
                    got += n
        except OSError as exc:
            self.drop(key)
            return empty, 0, f"unreadable: {exc}"
        why = self._check(header, view[:got], key)
        if why:
            self.drop(key)
            return empty, 0, why
        assert header is not None
        return payload, header.flags, ""

    def _check(self, header: record.Header | None, payload: memoryview, key: int) -> str:
        return (
            "not a tier record"
            if header is None
            else record.check(header, self.ident, payload, key)
        )

    def drop(self, key: int) -> bool:
        with self._lock:
            held = self._files.pop(key, None)
            if held is not None:
                self.used -= held[0]
        self.path(key).unlink(missing_ok=True)
        return held is not None

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = -1
