"""Unpickling with an allow-list: read foreign pickles (torch checkpoints, tiktoken encodings)
without executing anything they name.

A pickle can call any importable callable (`os.system` through a `__reduce__`, for one).
`restricted_loads` admits only the globals of `allowed`, each mapped to a local stand-in,
so the only code that runs is ours; any other global raises `UnsafePickleError` naming the
source and the global before anything is called.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from bov_jax.errors import UserError


class UnsafePickleError(UserError):
    """A pickle names a global outside the allow-list (or is not a pickle at all)."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(
        self,
        data: bytes,
        source: str,
        allowed: Mapping[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None,
    ):
        super().__init__(io.BytesIO(data))
        self._source = source
        self._allowed = allowed
        self._persistent_load = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            allowed = ", ".join(f"{m}.{n}" for m, n in self._allowed)
            raise UnsafePickleError(
                f"{self._source}: refusing to unpickle the global {module}.{name}; only "
                f"{allowed} are allowed (nothing was executed)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent_load is None:
            raise UnsafePickleError(f"{self._source}: unexpected persistent id {pid!r}")
        return self._persistent_load(pid)


def restricted_loads(
    data: bytes,
    source: str,
    allowed: Mapping[tuple[str, str], Any],
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """pickle.loads(data) where global (module, name) resolves to allowed[(module, name)].

    `source` names the file in errors. Raises UnsafePickleError for any other global and for
    data that is not a well-formed pickle.
    """
    try:
        return _RestrictedUnpickler(data, source, allowed, persistent_load).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, IndexError, KeyError) as err:
        raise UnsafePickleError(
            f"{source}: not a readable pickle of the expected kind: {err}"
        ) from err
