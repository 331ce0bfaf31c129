"""Read and write PyTorch `torch.save` files of a state dict, without torch.

The format (torch >= 1.6): an uncompressed zip whose entries sit under one directory NAME,

    NAME/data.pkl      a pickle of an OrderedDict {key: tensor}; each tensor pickles as
                       torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
                       requires_grad, backward_hooks[, metadata]), and each storage as a
                       persistent id ('storage', torch.<Type>Storage, KEY, location, numel)
    NAME/data/KEY      the storage's raw bytes, little-endian
    NAME/byteorder     "little"
    NAME/version       the format version

`read_state_dict` unpickles data.pkl through `bov_jax.interop.safe_pickle` with only those globals
(and collections.OrderedDict) allowed, mapped to NumPy builders: a checkpoint that names
anything else is refused before anything runs. bf16 storages become ml_dtypes.bfloat16.
`write_state_dict` writes the same layout (protocol 2, 64-byte aligned storages, as torch
writes them) from NumPy arrays, so `torch.load` reads it.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from bov_jax.errors import UserError
from bov_jax.files import atomic_file
from bov_jax.interop.safe_pickle import restricted_loads

STORAGE_DTYPES: dict[str, np.dtype] = {
    "FloatStorage": np.dtype(np.float32),
    "DoubleStorage": np.dtype(np.float64),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64),
    "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8),
    "BoolStorage": np.dtype(np.bool_),
}
_STORAGE_NAMES = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
_ALIGNMENT = 64  # torch aligns every storage record to 64 bytes (mmap loading)
_FORMAT_VERSION = b"3\n"


class TorchFormatError(UserError):
    """A .pt file that is not a torch state dict this reader understands."""


class _StorageType:
    """Stand-in for torch.<Type>Storage: the NumPy dtype of a storage."""

    def __init__(self, name: str):
        self.name, self.dtype = name, STORAGE_DTYPES[name]


@dataclasses.dataclass(frozen=True)
class _TensorRecord:
    """What a pickled tensor says (storage, offset, size, stride), checked by `tensor` before
    any view of the storage is made."""

    storage: np.ndarray
    offset: Any
    size: Any
    stride: Any

    def problem(self) -> str | None:
        """Why this record cannot be read safely, or None."""
        size, stride, offset = self.size, self.stride, self.offset
        if not all(isinstance(x, tuple) for x in (size, stride)) or len(size) != len(stride):
            return f"size {size!r} and stride {stride!r} are not two tuples of one length"
        if not all(_count(x) for x in (offset, *size, *stride)):
            return f"offset {offset!r}, size {size} or stride {stride} is not all integers >= 0"
        if 0 in size:
            return None
        last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if last >= self.storage.size:
            return f"its last element ({last}) lies outside its storage of {self.storage.size}"
        if math.prod(size) > self.storage.size:
            return f"{math.prod(size)} elements over a storage of {self.storage.size} (overlapping)"
        return None

    def tensor(self, key: str, path: Path) -> np.ndarray:
        """The tensor, copied out of its storage; TorchFormatError naming it if the record
        points outside the storage."""
        problem = self.problem()
        if problem:
            raise TorchFormatError(f"{path}: tensor {key}: {problem}; not read")
        if 0 in self.size:
            return np.zeros(self.size, self.storage.dtype)
        itemsize = self.storage.dtype.itemsize
        # The stride of a dimension of size 1 is never used (and may be anything).
        strides = tuple(s * itemsize if n > 1 else 0 for n, s in zip(self.size, self.stride))
        view = np.lib.stride_tricks.as_strided(
            self.storage[self.offset :], shape=self.size, strides=strides
        )
        return np.array(view)


def _count(value: Any) -> bool:
    """An integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, *metadata):
    """torch._utils._rebuild_tensor_v2 on a NumPy storage: the record, read once checked."""
    del requires_grad, hooks, metadata
    return _TensorRecord(storage, offset, tuple(size) if isinstance(size, list) else size, stride)


def _rebuild_parameter(data, requires_grad=False, hooks=None, *rest):
    del requires_grad, hooks, rest
    return data


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


def _archive_prefix(archive: zipfile.ZipFile, path: Path) -> str:
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise TorchFormatError(
            f"{path}: expected one NAME/data.pkl entry in a torch zip file, found {pickles}"
        )
    return pickles[0].removesuffix("data.pkl")


def read_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of a `torch.save`d state dict, as NumPy arrays (bf16 via ml_dtypes).

    Raises TorchFormatError (a missing or legacy-format file, a big-endian file, a missing
    storage, a non-tensor value) or UnsafePickleError (a global outside the allow-list),
    each naming the file.
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise TorchFormatError(
            f"{path}: not a torch zip checkpoint (missing, or saved with "
            "_use_new_zipfile_serialization=False)"
        )
    with zipfile.ZipFile(path) as archive:
        prefix = _archive_prefix(archive, path)
        names = set(archive.namelist())
        if f"{prefix}byteorder" in names:
            order = archive.read(f"{prefix}byteorder").decode().strip()
            if order != "little":
                raise TorchFormatError(f"{path}: byte order {order!r}; only 'little' is supported")

        def load_storage(pid: Any) -> np.ndarray:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise TorchFormatError(f"{path}: unexpected persistent id {pid!r}")
            _, storage_type, key, _location, numel = pid
            if not isinstance(storage_type, _StorageType):
                raise TorchFormatError(f"{path}: storage {key!r} has no storage type")
            entry = f"{prefix}data/{key}"
            if entry not in names:
                raise TorchFormatError(f"{path}: storage entry {entry} is missing")
            expected = numel * storage_type.dtype.itemsize if _count(numel) else -1
            size = archive.getinfo(entry).file_size  # checked before anything is read
            if size != expected:
                raise TorchFormatError(
                    f"{path}: storage {entry} holds {size} bytes, expected {numel!r} "
                    f"{storage_type.name} elements"
                )
            return np.frombuffer(archive.read(entry), storage_type.dtype)

        try:
            state = restricted_loads(
                archive.read(f"{prefix}data.pkl"),
                f"{path}:{prefix}data.pkl",
                _ALLOWED,
                load_storage,
            )
        except ValueError as err:
            raise TorchFormatError(f"{path}: {err}") from err
    if not isinstance(state, dict):
        raise TorchFormatError(f"{path}: holds a {type(state).__name__}, not a state dict")
    bad = sorted(str(k) for k, v in state.items() if not isinstance(v, _TensorRecord))
    if bad:
        raise TorchFormatError(f"{path}: entries that are not tensors: {', '.join(bad)}")
    for key, record in state.items():  # every record checked before any tensor is read
        if problem := record.problem():
            raise TorchFormatError(f"{path}: tensor {key}: {problem}; not read")
    return {str(k).removeprefix("_orig_mod."): r.tensor(str(k), path) for k, r in state.items()}


# ---------------------------------------------------------------------------------------------
# Writing


class _Global:
    """A module-level name to be pickled as a GLOBAL opcode (torch need not be importable)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:
        raise TypeError(f"{self.module}.{self.name} is a pickling placeholder")


_REBUILD_TENSOR = _Global("torch._utils", "_rebuild_tensor_v2")
_ORDERED_DICT = _Global("collections", "OrderedDict")


class _Storage:
    def __init__(self, key: str, array: np.ndarray):
        self.key, self.array = key, array


class _Tensor:
    """Pickles as _rebuild_tensor_v2 of a whole contiguous storage."""

    def __init__(self, storage: _Storage):
        self.storage = storage

    def __reduce__(self) -> tuple:
        shape = self.storage.array.shape
        strides = tuple(int(np.prod(shape[i + 1 :], dtype=np.int64)) for i in range(len(shape)))
        empty_hooks = _EmptyOrderedDict()
        return _REBUILD_TENSOR, (self.storage, 0, shape, strides, False, empty_hooks)


class _EmptyOrderedDict:
    def __reduce__(self) -> tuple:
        return _ORDERED_DICT, ()


class _StateDict(dict):
    """Pickles as OrderedDict() followed by its items (SETITEMS)."""

    def __reduce__(self) -> tuple:
        return _ORDERED_DICT, (), None, None, iter(self.items())


class _TorchPickler(pickle._Pickler):
    """Protocol-2 pickler that writes `_Global`s as GLOBAL opcodes and storages as persistent
    ids. The pure-Python pickler is used because its dispatch table can be extended."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_global_ref(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.memoize(obj)

    dispatch[_Global] = _save_global_ref

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            storage_type = _Global("torch", _STORAGE_NAMES[obj.array.dtype])
            return ("storage", storage_type, obj.key, "cpu", int(obj.array.size))
        return None


def _aligned_entry(archive: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    """A stored entry whose data starts at a multiple of 64 bytes (padding in an 'FB' extra
    field, as torch's writer does)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    header = archive.fp.tell() + 30 + len(name.encode()) + 4
    pad = -header % _ALIGNMENT
    info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return info


def write_state_dict(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Write `tensors` (name -> array, dtypes of STORAGE_DTYPES) as a torch.save file (atomic).

    The archive directory is the file's stem, as torch names it.
    """
    path = Path(path)
    for key, array in tensors.items():
        if np.dtype(array.dtype) not in _STORAGE_NAMES:
            raise TorchFormatError(f"{path}: tensor {key} has unsupported dtype {array.dtype}")
    storages = {
        k: _Storage(str(i), np.ascontiguousarray(a)) for i, (k, a) in enumerate(tensors.items())
    }
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=2).dump(_StateDict({k: _Tensor(s) for k, s in storages.items()}))
    prefix = path.stem + "/"
    with atomic_file(path) as out, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(_aligned_entry(archive, prefix + "data.pkl"), buffer.getvalue())
        archive.writestr(_aligned_entry(archive, prefix + "byteorder"), b"little")
        for storage in storages.values():
            entry = _aligned_entry(archive, f"{prefix}data/{storage.key}")
            archive.writestr(entry, storage.array.tobytes())
        archive.writestr(_aligned_entry(archive, prefix + "version"), _FORMAT_VERSION)
