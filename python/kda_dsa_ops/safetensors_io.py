"""Reading and writing the safetensors format (a little-endian u64 header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw bytes), single files or sharded with a
`model.safetensors.index.json`. Tensors are read one byte range at a time, and every byte read is
counted, so that a loader can show it only read what it needed."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as written: the message names the file and the tensor."""


@dataclass(frozen=True)
class Entry:
    file: str
    dtype: torch.dtype
    shape: tuple
    begin: int  # absolute byte offset in the file
    end: int


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)


def write_sharded(directory: str, tensors: dict[str, torch.Tensor], shard_bytes: int) -> None:
    """Files of at most about shard_bytes each, plus the index (the layout of sharded checkpoints)."""
    os.makedirs(directory, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(os.path.join(directory, file), shard)
        weight_map.update({name: file for name in shard})
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


class Reader:
    """The tensors of a checkpoint (a .safetensors file, or a directory with one or with an index);
    headers are read up front, tensor bytes on demand (`bytes_read` counts them). Every header is
    checked as the format requires (a JSON object of entries with a dtype, a shape and offsets;
    the entries' byte ranges tile the data exactly, in any order; no name twice across the
    files; the index's files exist): anything else is a CheckpointError naming the file."""

    def __init__(self, path: str):
        self.entries: dict[str, Entry] = {}
        self.bytes_read = 0
        files = self._files(path)
        for file in files:
            self._read_header(file)

    @staticmethod
    def _files(path: str) -> list[str]:
        if os.path.isfile(path):
            return [path]
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint file or directory")
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                names = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
                raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map of "
                                      f"tensor -> file): {err!r}") from None
            missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
            if missing:
                raise CheckpointError(f"{index} names files that are not there: {missing}")
            return [os.path.join(path, name) for name in names]
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no .safetensors file and no {INDEX}")
        return files

    def _read_header(self, file: str) -> None:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated ({size} bytes, not even a header length)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CheckpointError(f"{file}: header of {n} bytes runs past the end of the file ({size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{file}: unreadable header ({err})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{file}: the header is a JSON {type(header).__name__}, not an object of tensors")
        header.pop("__metadata__", None)
        ranges = []
        for name, info in header.items():
            try:
                dtype_name, shape, (first, last) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
                first, last = int(first), int(last)
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{file}: tensor {name}'s entry needs a dtype, a shape and two data_offsets, "
                                      f"got {info!r} ({err!r})") from None
            if name in self.entries:
                raise CheckpointError(f"{file}: tensor {name} is also in {self.entries[name].file}")
            dtype = DTYPES.get(dtype_name)
            if dtype is None:
                raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {dtype_name}")
            begin, end = 8 + n + first, 8 + n + last
            expected = dtype.itemsize * int(torch.Size(shape).numel())
            if end - begin != expected:
                raise CheckpointError(f"{file}: tensor {name} holds {end - begin} bytes, its shape {list(shape)} "
                                      f"and dtype {dtype_name} need {expected}")
            if end > size:
                raise CheckpointError(f"{file}: tensor {name} ends at byte {end}, past the end of the file "
                                      f"({size} bytes): truncated")
            ranges.append((first, last, name))
            self.entries[name] = Entry(file, dtype, shape, begin, end)
        at = 0
        for first, last, name in sorted(ranges):
            if first != at:
                raise CheckpointError(f"{file}: tensor {name}'s bytes start at {first}, expected {at}: the tensors' "
                                      "data_offsets must tile the data without gaps or overlaps")
            at = last
        if 8 + n + at != size:
            raise CheckpointError(f"{file}: {size - 8 - n - at} bytes after the last tensor's data")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        with open(e.file, "rb") as f:
            f.seek(e.begin)
            data = f.read(e.end - e.begin)
        if len(data) != e.end - e.begin:
            raise CheckpointError(f"{e.file}: tensor {name} is truncated")
        self.bytes_read += len(data)
        if not data:
            return torch.empty(e.shape, dtype=e.dtype)
        return torch.frombuffer(bytearray(data), dtype=e.dtype).reshape(e.shape)
