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
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import torch

# Called as progress(tensors_loaded, tensors_total).
ProgressFn = Callable[[int, int], None]

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
    """

    def __init__(
        self, entries: dict[str, TensorEntry], names: Sequence[str], progress: ProgressFn | None
    ) -> None:
        self._entries = entries
        self._files = ExitStack()
        self._handles: dict[Path, io.FileIO] = {}
        self._buffer = bytearray(max((entries[n].num_bytes for n in names), default=0))
        self._progress = progress
        self.num_read = 0
        self.num_total = len(names)

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
        """The tensor as stored (file dtype, on the host), as a view of the shared buffer."""
        e = self._entries[name]
        f = self._handles.get(e.file)
        if f is None:
            f = self._handles[e.file] = self._files.enter_context(e.file.open("rb", buffering=0))
        f.seek(e.offset)
        view = memoryview(self._buffer)[: e.num_bytes]
        done = 0
        while done < e.num_bytes:
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(
                    f"{e.file}: cannot read tensor {name!r}: the file ends after {done} of "
                    f"its {e.num_bytes} bytes"
                )
            done += n
        self.num_read += 1
        if self._progress is not None:
            self._progress(self.num_read, self.num_total)
        if e.num_bytes == 0:
            return torch.empty(e.shape, dtype=e.dtype, device="cpu")  # host staging
        numel = e.num_bytes // e.dtype.itemsize
        return torch.frombuffer(self._buffer, dtype=e.dtype, count=numel).view(e.shape)
