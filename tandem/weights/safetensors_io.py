"""Reading safetensors files one tensor at a time, without mmap.

The header (8-byte little-endian length, then JSON: name -> dtype, shape, data_offsets) is
parsed here; each tensor is then read with plain `readinto` into one reused host buffer.
Mapped file pages count towards the process's resident memory for as long as the mapping
lives, page cache does not (safetensors' own `get_tensor` returns views into a mapping of the
whole file, so one weight kept as such a view keeps every page that was read resident).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import torch

from tandem.parallel.sharding import TensorSlice

# Called as progress(tensors_loaded, tensors_total).
ProgressFn = Callable[[int, int], None]

# A column slice is read a run of whole rows at a time, through a chunk of about this size.
COLUMN_CHUNK_BYTES = 1 << 20

# safetensors dtype names -> torch dtypes.
FILE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a model dir: the sharded index's files, or model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = [model_dir / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"missing weight file {f}")
    return files


class TensorEntry(NamedTuple):
    """Where one tensor's bytes sit in a safetensors file."""

    file: Path
    dtype: torch.dtype  # as stored
    shape: tuple[int, ...]
    offset: int  # of its first byte, from the start of the file
    num_bytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and check a safetensors header.

    Layout: an 8-byte little-endian header length n, n bytes of JSON
    ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}),
    then the data; offsets count from the start of the data.

    Raises:
        ValueError: the file is not a valid safetensors file.
    """

    def invalid(reason: str) -> ValueError:
        return ValueError(f"{path} is not a valid safetensors file: {reason}")

    file_bytes = path.stat().st_size
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if file_bytes < 8 or header_len > file_bytes - 8:
            raise invalid(f"header length {header_len} does not fit in {file_bytes} bytes")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise invalid(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise invalid("header is not a JSON object")
    data_start = 8 + header_len
    data_bytes = file_bytes - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = FILE_DTYPES[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise invalid(f"tensor {name!r} has a malformed entry {info!r}") from None
        if not all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)):
            raise invalid(f"tensor {name!r} has a malformed entry {info!r}")
        num_bytes = math.prod(shape) * dtype.itemsize
        if end - begin != num_bytes or end > data_bytes:
            raise invalid(
                f"tensor {name!r} ({info['dtype']} {list(shape)}, {num_bytes} bytes) has "
                f"data_offsets [{begin}, {end}] in {data_bytes} bytes of data"
            )
        entries[name] = TensorEntry(path, dtype, shape, data_start + begin, num_bytes)
    return entries


class TensorReader:
    """Reads tensors one at a time into one host buffer, sized for the largest of them.

    `read` returns a view of that buffer: it is valid until the next `read`, so callers copy
    it into place at once and keep no reference. A context manager: leaving it closes the
    files.

    `slices` (tensor parallelism, tandem.parallel.sharding): those tensors are read only in
    part, and the buffer is sized for the parts. Rows are one contiguous read; columns
    (a 2-D tensor's) are read in runs of whole rows through a small chunk and copied out:

        file:   row 0 [ .. | cols | .. ]     buffer: [ slice rows x cols | chunk ]
                row 1 [ .. | cols | .. ]
    """

    def __init__(
        self,
        entries: dict[str, TensorEntry],
        names: Sequence[str],
        progress: ProgressFn | None,
        slices: Mapping[str, TensorSlice] | None = None,
    ) -> None:
        self._entries = entries
        self._files = ExitStack()
        self._handles: dict[Path, io.FileIO] = {}
        self._slices = dict(slices or {})
        self._buffer = bytearray(max((self._buffer_bytes(n) for n in names), default=0))
        self._progress = progress
        self.num_read = 0
        self.num_total = len(names)

    def _buffer_bytes(self, name: str) -> int:
        e = self._entries[name]
        sl = self._slices.get(name)
        if sl is None:
            return e.num_bytes
        row_bytes = e.num_bytes // max(e.shape[0], 1)
        if sl.dim == 0:
            return (sl.stop - sl.start) * row_bytes
        return e.num_bytes // e.shape[1] * (sl.stop - sl.start) + self._chunk_rows(e) * row_bytes

    @staticmethod
    def _chunk_rows(e: TensorEntry) -> int:
        row_bytes = max(e.num_bytes // max(e.shape[0], 1), 1)
        return max(1, min(e.shape[0], COLUMN_CHUNK_BYTES // row_bytes))

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._files.close()

    def read(self, name: str) -> torch.Tensor:
        """The tensor as stored (file dtype, on the host), as a view of the shared buffer;
        only its slice when the reader was given one for it."""
        e = self._entries[name]
        f = self._handles.get(e.file)
        if f is None:
            f = self._handles[e.file] = self._files.enter_context(e.file.open("rb", buffering=0))
        sl = self._slices.get(name)
        if sl is None:
            self._read_into(f, e.offset, memoryview(self._buffer)[: e.num_bytes], name, e)
            shape, num_bytes = e.shape, e.num_bytes
        elif sl.dim == 0:
            row_bytes = e.num_bytes // e.shape[0]
            num_bytes = (sl.stop - sl.start) * row_bytes
            view = memoryview(self._buffer)[:num_bytes]
            self._read_into(f, e.offset + sl.start * row_bytes, view, name, e)
            shape = (sl.stop - sl.start, *e.shape[1:])
        else:
            shape, num_bytes = self._read_columns(f, e, sl, name)
        self.num_read += 1
        if self._progress is not None:
            self._progress(self.num_read, self.num_total)
        if num_bytes == 0:
            return torch.empty(shape, dtype=e.dtype, device="cpu")  # host staging
        numel = num_bytes // e.dtype.itemsize
        return torch.frombuffer(self._buffer, dtype=e.dtype, count=numel).view(shape)

    def _read_columns(
        self, f: io.FileIO, e: TensorEntry, sl: TensorSlice, name: str
    ) -> tuple[tuple[int, ...], int]:
        """Columns [sl.start, sl.stop) of a 2-D tensor into the front of the buffer."""
        if len(e.shape) != 2:
            raise ValueError(f"tensor {name!r} {e.shape}: only 2-D tensors split by columns")
        rows, cols = e.shape
        item = e.dtype.itemsize
        width = sl.stop - sl.start
        num_bytes = rows * width * item
        out = torch.frombuffer(self._buffer, dtype=torch.uint8, count=num_bytes)
        out = out.view(rows, width * item)
        chunk_rows = self._chunk_rows(e)
        chunk = memoryview(self._buffer)[num_bytes : num_bytes + chunk_rows * cols * item]
        chunk_t = torch.frombuffer(chunk, dtype=torch.uint8).view(chunk_rows, cols * item)
        for r in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - r)
            self._read_into(f, e.offset + r * cols * item, chunk[: n * cols * item], name, e)
            out[r : r + n] = chunk_t[:n, sl.start * item : sl.stop * item]
        return (rows, width), num_bytes

    @staticmethod
    def _read_into(f: io.FileIO, offset: int, view: memoryview, name: str, e: TensorEntry) -> None:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(
                    f"{e.file}: cannot read tensor {name!r}: the file ends after "
                    f"{offset - e.offset + done} of its {e.num_bytes} bytes"
                )
            done += n
