"""numba types of the kernels' NamedTuple arguments, built once per distinct layout of their fields.

numba's dispatcher types each argument of every call. What it can fingerprint in C (arrays, scalars, tuples
of them) costs microseconds; a NamedTuple holding a typed List it cannot, so it falls back to Python's
typeof, which rebuilds and interns the whole nested type on every call. A class registered here is typed
from a key of its fields instead (numba's own fingerprints, a typed List's item type, a registered field's
type), and each distinct key's type is built by numba's typeof once. A call of the default model's decoder
(all its layers) went from 283 to 78 us of dispatch, its head's from 43 to 9 (of a 9 ms decode step; the
rest is numba hashing the type it is handed).
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

from numba.core import types
from numba.core.typing.typeof import typeof_impl
from numba.typed import List

# numba's C fingerprint, the key of its own typecode cache (None in a numba without it: numba's typeof then)
compute_fingerprint: Any = getattr(importlib.import_module("numba._dispatcher"), "compute_fingerprint", None)

Cls = TypeVar("Cls", bound=type)

_registered: set[type] = set()
_types: dict[tuple[object, ...], types.Type] = {}


def _field_key(value: object, c: Any) -> object:
    # A type stands in by its typecode: numba interns types and numbers each once, and hashing a nested
    # type itself walks all of it (most of the cost this module removes).
    if isinstance(value, List):
        return value._numba_type_._code
    if type(value) in _registered:
        return typeof_impl(value, c)._code
    return compute_fingerprint(value)  # NotImplementedError (or ValueError): a field with no fingerprint


def register_memoized_type(cls: Cls) -> Cls:
    """Type `cls` (a NamedTuple class) from its fields' keys, numba's typeof once per key. Returns `cls`."""
    if compute_fingerprint is None or cls in _registered:
        return cls
    _registered.add(cls)

    @typeof_impl.register(cls)
    def _typeof(val: tuple[Any, ...], c: Any) -> types.Type | None:
        try:
            key = (cls, c.purpose, *(_field_key(v, c) for v in val))
        except (NotImplementedError, ValueError):
            key = None
        ty = _types.get(key) if key is not None else None
        if ty is None:
            tys = [typeof_impl(v, c) for v in val]
            if any(t is None for t in tys):
                return None
            ty = types.BaseTuple.from_types(tys, cls)
            if key is not None:
                _types[key] = ty
        return ty

    return cls
