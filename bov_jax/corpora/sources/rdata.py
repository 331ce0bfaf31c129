"""Read character vectors out of an R lazy-load database (`Rdata.rdx` + `Rdata.rdb`) without R.

The index (`.rdx`) is a gzip-compressed serialized R list whose `variables` element maps each
object name to an (offset, length) pair in the `.rdb` file. Each `.rdb` entry is a 4-byte
big-endian uncompressed length followed by a zlib stream holding one serialized object in XDR
format. Only the object types that data packages such as janeaustenr use are decoded.
"""

import gzip
import struct
import zlib
from pathlib import Path

_NILVALUE, _REF, _GLOBALENV, _EMPTYENV, _BASEENV, _MISSINGARG = 254, 255, 253, 242, 241, 251
_SYMSXP, _LISTSXP, _CHARSXP, _LGLSXP, _INTSXP, _REALSXP, _STRSXP, _VECSXP = (
    1,
    2,
    9,
    10,
    13,
    14,
    16,
    19,
)
_HAS_ATTR, _HAS_TAG = 1 << 9, 1 << 10


class _XdrReader:
    """Decodes one serialized R object (format 'X', versions 2 and 3)."""

    def __init__(self, data: bytes, origin: str):
        self._data = data
        self._pos = 0
        self._origin = origin
        self._refs: list[object] = []

    def _fail(self, problem: str) -> ValueError:
        return ValueError(f"{self._origin}: {problem} at byte {self._pos}")

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self._data, self._pos)
        self._pos += 4
        return value

    def _bytes(self, n: int) -> bytes:
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def read_header(self) -> None:
        if self._bytes(2) != b"X\n":
            raise self._fail("not an XDR-serialized R object")
        version = self._int()
        self._int(), self._int()  # writer R version, minimal reader version
        if version == 3:
            self._bytes(self._int())  # native encoding name
        elif version != 2:
            raise self._fail(f"unsupported serialization version {version}")

    def read_item(self) -> object:
        flags = self._int()
        kind = flags & 0xFF
        if kind in (_NILVALUE, _GLOBALENV, _EMPTYENV, _BASEENV, _MISSINGARG):
            return None
        if kind == _REF:
            return self._refs[(flags >> 8) - 1]
        if kind == _SYMSXP:
            name = self.read_item()
            self._refs.append(name)
            return name
        if kind == _LISTSXP:
            if flags & _HAS_ATTR:
                self.read_item()  # attributes of a pairlist cell are never needed here
            tag = self.read_item() if flags & _HAS_TAG else None
            head = self.read_item()
            tail = self.read_item()
            return [(tag, head)] + (tail if isinstance(tail, list) else [])
        if kind == _CHARSXP:
            n = self._int()
            return None if n == -1 else self._bytes(n).decode("utf-8", errors="strict")
        if kind in (_LGLSXP, _INTSXP):
            out: object = list(struct.unpack_from(f">{self._int()}i", self._data, self._pos))
            self._pos += 4 * len(out)
        elif kind == _REALSXP:
            out = list(struct.unpack_from(f">{self._int()}d", self._data, self._pos))
            self._pos += 8 * len(out)
        elif kind in (_STRSXP, _VECSXP):
            out = [self.read_item() for _ in range(self._int())]
        else:
            raise self._fail(f"unsupported R object type {kind}")
        if flags & _HAS_ATTR:
            attrs = self.read_item()
            names = dict(attrs).get("names") if isinstance(attrs, list) else None
            if kind == _VECSXP and names is not None:
                return dict(zip(names, out))
        return out


def _unserialize(data: bytes, origin: str) -> object:
    reader = _XdrReader(data, origin)
    reader.read_header()
    return reader.read_item()


def read_lazyload_db(rdx_path: Path) -> dict[str, object]:
    """Returns every object of the lazy-load database whose index is `rdx_path` (name -> value).

    Character vectors come back as list[str | None], integer vectors as list[int], named lists as
    dict. `rdx_path` names `X.rdx`; the data is read from `X.rdb` next to it.
    """
    index = _unserialize(gzip.decompress(rdx_path.read_bytes()), str(rdx_path))
    if not isinstance(index, dict) or not isinstance(index.get("variables"), dict):
        raise ValueError(f"{rdx_path}: no 'variables' table in the lazy-load index")
    rdb_path = rdx_path.with_suffix(".rdb")
    blob = rdb_path.read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        entry = blob[offset : offset + length]
        objects[name] = _unserialize(zlib.decompress(entry[4:]), f"{rdb_path}[{name}]")
    return objects
