"""The memory-mapped indexed dataset files DeepSpeed's data analyzer writes and its curriculum sampler reads.

Megatron's "MMIDIDX" layout, which DeepSpeed and Megatron-DeepSpeed share, so files written by either load here
and the other way round. A dataset `<prefix>` is two files:

- `<prefix>.bin`: the rows' elements back to back, all of one integer type;
- `<prefix>.idx`: the magic `b"MMIDIDX\\x00\\x00"`, version (u64 = 1), the type code (u8, `_TYPES`), the number
  of rows (u64), the number of document boundaries (u64), then each row's length (int32), each row's byte
  offset into `.bin` (int64) and the document boundaries (int64 row numbers, starting with 0).

The curriculum sampler uses it for the analyzer's `index_to_sample` (row i: the samples of the i-th metric
value, values ascending), `index_to_metric` (row i: that value) and its own clusters (one row: a shuffled
list of sample indices). DeepSpeed reads and writes it with NumPy; here rows are torch tensors read straight
from the mapped file and written with the standard library's `array`, so the library needs no NumPy. Reading
maps the files (copy-on-write: a row tensor can be changed without touching the file); nothing is loaded
until a row is read.
"""

from __future__ import annotations

import array
import mmap
import os
import struct
import sys
from pathlib import Path

import torch

__all__ = [
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "close_mmap_dataset_builder",
    "create_mmap_dataset_builder",
    "find_fit_int_dtype",
    "write_rows",
]

_MAGIC = b"MMIDIDX\x00\x00"
# type code -> (torch dtype, the `array` typecode of the same width and sign)
_TYPES: dict[int, tuple[torch.dtype, str]] = {
    1: (torch.uint8, "B"),
    2: (torch.int8, "b"),
    3: (torch.int16, "h"),
    4: (torch.int32, "i"),
    5: (torch.int64, "q"),
    6: (torch.uint16, "H"),
    7: (torch.uint32, "I"),
    8: (torch.uint64, "Q"),
}
_CODE_OF = {dtype: code for code, (dtype, _) in _TYPES.items()}
_LIMITS = [  # smallest first, as DeepSpeed picks them
    (torch.uint8, 0, 255), (torch.uint16, 0, 65535), (torch.uint32, 0, 2**32 - 1), (torch.uint64, 0, 2**64 - 1),
    (torch.int8, -128, 127), (torch.int16, -(2**15), 2**15 - 1), (torch.int32, -(2**31), 2**31 - 1),
]  # fmt: skip


def find_fit_int_dtype(min_value: int, max_value: int) -> torch.dtype:
    """The smallest integer dtype holding [min_value, max_value] (unsigned when min_value >= 0)."""
    for dtype, low, high in _LIMITS:
        if (low == 0) == (min_value >= 0) and low <= min_value and max_value <= high:
            return dtype
    return torch.int64


def _dtype(dtype) -> torch.dtype:
    """A torch integer dtype from a torch dtype or a NumPy type/name (`np.uint16`, "int64")."""
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, getattr(dtype, "__name__", str(dtype)), None)
    if dtype not in _CODE_OF:
        raise ValueError(f"indexed dataset dtype {dtype}: one of {sorted(str(d) for d in _CODE_OF)}")
    return dtype


class MMapIndexedDataset:
    """The rows of the dataset `path` (without `.bin`/`.idx`): `ds[i]` is row i as a 1-D tensor."""

    def __init__(self, path: str | os.PathLike, skip_warmup: bool = True):
        # skip_warmup: DeepSpeed's option to read the files once before mapping them; mapping suffices here
        self.path = str(path)
        index = _map(self.path + ".idx")
        if index[: len(_MAGIC)] != _MAGIC:
            raise ValueError(f"{self.path}.idx is not an MMIDIDX index file (wrong magic bytes)")
        at = len(_MAGIC)
        version, code, rows, documents = struct.unpack_from("<QBQQ", index, at)
        if version != 1:
            raise ValueError(f"{self.path}.idx has index version {version}; only version 1 exists")
        self.dtype = _TYPES[code][0]
        at += struct.calcsize("<QBQQ")
        self.sizes = (
            torch.frombuffer(index, dtype=torch.int32, count=rows, offset=at) if rows else torch.zeros(0)
        )
        self._pointers = (
            torch.frombuffer(index, dtype=torch.int64, count=rows, offset=at + 4 * rows) if rows else None
        )
        self.doc_idx = torch.frombuffer(index, dtype=torch.int64, count=documents, offset=at + 12 * rows)
        self._data = _map(self.path + ".bin") if rows else None

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {self.path} (it has {len(self)} rows)")
        i %= len(self)
        count, offset = int(self.sizes[i]), int(self._pointers[i])
        if count == 0:
            return torch.zeros(0, dtype=self.dtype)
        return torch.frombuffer(self._data, dtype=self.dtype, count=count, offset=offset)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> torch.Tensor:
        """Part of row `i`: `length` elements from `offset` (to the row's end by default)."""
        row = self[i]
        return row[offset:] if length is None else row[offset : offset + length]

    @staticmethod
    def exists(path: str | os.PathLike) -> bool:
        return os.path.exists(f"{path}.idx") and os.path.exists(f"{path}.bin")


def _map(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


class MMapIndexedDatasetBuilder:
    """Writes `<prefix>.bin` row by row; `finalize("<prefix>.idx")` writes the index. Rows are converted to
    the builder's dtype (a torch dtype, or a NumPy type as DeepSpeed's builder takes)."""

    def __init__(self, out_file: str | os.PathLike, dtype=torch.int64):
        self.dtype = _dtype(dtype)
        self._typecode = _TYPES[_CODE_OF[self.dtype]][1]
        self._file = open(out_file, "wb")  # noqa: SIM115 - kept open across add_item calls, closed in finalize
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, values) -> None:
        """Append one row: a tensor, or any sequence of integers (a NumPy array too)."""
        values = values.reshape(-1).tolist() if hasattr(values, "tolist") else list(values)
        self._file.write(_little_endian(array.array(self._typecode, values)))
        self._sizes.append(len(values))

    add_item_numpy = add_item  # DeepSpeed's name for the same

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file: str | os.PathLike) -> None:
        self._file.close()
        width = torch.empty(0, dtype=self.dtype).element_size()
        pointers, at = [], 0
        for size in self._sizes:
            pointers.append(at)
            at += size * width
        with open(index_file, "wb") as index:
            index.write(
                _MAGIC + struct.pack("<QBQQ", 1, _CODE_OF[self.dtype], len(self._sizes), len(self._doc_idx))
            )
            index.write(_little_endian(array.array("i", self._sizes)))
            index.write(_little_endian(array.array("q", pointers)))
            index.write(_little_endian(array.array("q", self._doc_idx)))


def _little_endian(values: array.array) -> bytes:
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def write_rows(prefix: str | os.PathLike, rows, dtype) -> None:
    """Write `rows` as the dataset `prefix` (one document), atomically: both files appear complete or not at
    all, so a reader never maps a half-written cluster and two ranks writing the same content cannot tear it."""
    prefix = Path(prefix)
    tmp = prefix.with_name(f".{prefix.name}.{os.getpid()}.tmp")
    builder = MMapIndexedDatasetBuilder(f"{tmp}.bin", dtype)
    for row in rows:
        builder.add_item(row)
    builder.end_document()
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")


def create_mmap_dataset_builder(prefix: str | os.PathLike, dtype) -> MMapIndexedDatasetBuilder:
    """A builder writing the dataset `prefix` (DeepSpeed's helper; `close_mmap_dataset_builder` finishes it)."""
    return MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, prefix: str | os.PathLike) -> None:
    """End the builder's one document and write `prefix.idx`."""
    builder.end_document()
    builder.finalize(f"{prefix}.idx")
