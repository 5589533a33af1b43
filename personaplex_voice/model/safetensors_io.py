"""Safetensors files read and written tensor by tensor, with plain file reads (no mmap).

Why not `safetensors.torch.load_file`: it maps the whole file and returns every tensor at once,
so loading a 16.7 GB bfloat16 checkpoint into a float32 CPU model holds the file's pages and the
converted model together, and a CUDA load stages everything on the host first. Here each tensor
is read in chunks of `CHUNK_BYTES` straight into its destination (any dtype, any device): a
read into the destination's own memory when the dtypes match on the CPU, else through one small
staging buffer. Host memory beyond the destination tensors is one chunk; the file itself only
occupies the page cache, which is not the process's memory.

The format (https://github.com/huggingface/safetensors): a little-endian u64 header length, a
JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`
with offsets relative to the end of the header, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from personaplex_voice.errors import UserError

CHUNK_BYTES = 16 * 2**20
_MAX_HEADER = 100 * 2**20
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the file: absolute byte offsets [start, end)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """An open safetensors file; `entries` by name, `read` / `read_into` one tensor at a time.

    Every problem with the file (missing, truncated, bad header, offsets outside the file)
    raises `UserError` naming it, as `what` ("LM weights", "Mimi weights") says.
    """

    def __init__(self, path: str | Path, what: str = "weights"):
        self.path = Path(path)
        self.what = what
        if not self.path.is_file():
            raise UserError(f"{self.path}: {what} not found")
        try:
            self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115  # closed by close()
            # One staging buffer for every converting read. Allocated per tensor, glibc serves
            # the 16 MB from its heap once its mmap threshold has grown, and later tensors strand
            # the freed chunks: +16 MB of host memory per tensor, in some runs and not others.
            self._staging: torch.Tensor | None = None
        except OSError as exc:
            raise UserError(f"{self.path}: cannot read {what} ({exc})") from None
        try:
            self.entries, self.metadata = self._read_header()
        except BaseException:
            self._file.close()
            raise
        with contextlib.suppress(AttributeError, OSError):  # one sequential pass: read ahead
            os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def _bad(self, why: str) -> UserError:
        return UserError(f"{self.path}: not a valid safetensors file ({why})")

    def _read_header(self) -> tuple[dict[str, TensorEntry], dict[str, str]]:
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(8)
        if len(head) < 8:
            raise self._bad("too short")
        (length,) = struct.unpack("<Q", head)
        if length == 0 or length > _MAX_HEADER or 8 + length > size:
            raise self._bad("bad header length")
        try:
            header = json.loads(self._file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._bad(f"header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        base = 8 + length
        entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"unreadable entry for tensor {name!r}") from None
            entry = TensorEntry(name, dtype, shape, base + begin, base + end)
            element = torch.empty(0, dtype=dtype).element_size()
            if begin < 0 or end > size - base or entry.nbytes != entry.numel * element:
                raise self._bad(f"tensor {name!r} lies outside the file (truncated?)")
            entries[name] = entry
        return entries, metadata

    def read(
        self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Tensor `name` as a new tensor of `dtype` (default: the file's) on `device`."""
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=dtype or entry.dtype, device=device)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill the contiguous tensor `out` (shape of the entry, any dtype, any device) from the file."""
        entry = self.entries[name]
        if tuple(out.shape) != entry.shape:
            raise ValueError(f"{name}: shape {tuple(out.shape)} != {entry.shape} in the file")
        if not out.is_contiguous():
            raise ValueError(f"{name}: read_into needs a contiguous tensor")
        flat = out.view(-1)
        try:
            if out.device.type == "cpu" and out.dtype == entry.dtype and entry.nbytes:
                self._read_exact(entry.start, _bytes_of(flat))  # no copy at all
                return
            element = torch.empty(0, dtype=entry.dtype).element_size()
            per_chunk = max(1, CHUNK_BYTES // element)
            if self._staging is None:
                self._staging = torch.empty(max(CHUNK_BYTES, element), dtype=torch.uint8)
            staging = self._staging
            done = 0
            while done < entry.numel:
                n = min(per_chunk, entry.numel - done)
                view = staging[: n * element]
                self._read_exact(entry.start + done * element, _bytes_of(view))
                flat[done : done + n].copy_(view.view(entry.dtype))
                done += n
        except OSError as exc:
            raise UserError(f"{self.path}: cannot read {self.what} ({exc})") from None

    def _read_exact(self, offset: int, buffer: memoryview) -> None:
        self._file.seek(offset)
        view, got = buffer, 0
        while got < len(buffer):
            n = self._file.readinto(view[got:])
            if not n:
                raise self._bad("unexpected end of file")
            got += n

    def close(self) -> None:
        self._staging = None
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (numpy knows no bfloat16: go through uint8)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def write_safetensors(
    path: str | Path,
    specs: Iterable[TensorSpec],
    produce: Callable[[TensorSpec], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write a safetensors file holding the tensors of `specs`, each made by `produce(spec)` only
    when it is written (so a large file never needs all its tensors in memory). Returns the size."""
    specs = list(specs)
    header: dict[str, object] = {}
    offset = 0
    for spec in specs:
        element = torch.empty(0, dtype=spec.dtype).element_size()
        n = element
        for size in spec.shape:
            n *= size
        header[spec.name] = {
            "dtype": _NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            tensor = produce(spec)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(
                    f"{spec.name}: produced {tensor.dtype} {tuple(tensor.shape)}, expected {spec}"
                )
            f.write(_bytes_of(tensor.detach().cpu().contiguous().view(-1)))
    return 8 + len(raw) + offset


def save_state_dict(path: str | Path, tensors: dict[str, torch.Tensor]) -> int:
    """`tensors` as a safetensors file (a small file: everything is in memory already)."""
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    return write_safetensors(path, specs, lambda spec: tensors[spec.name])
