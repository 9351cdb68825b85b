"""The kernels' NamedTuple arguments typed from a key of their fields (kernels/cpu/arg_types.py)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numba
import numpy as np
import pytest
from numba.core import types
from numba.core.typing.typeof import Purpose, _TypeofContext, typeof_impl
from numba.typed import List

from metalserve.kernels.cpu.arg_types import register_memoized_type
from metalserve.kernels.cpu.packed_linear import Segments, segments_of
from tests.kernels.test_packed_codes import random_codes


@register_memoized_type
class Held(NamedTuple):
    arrays: List
    weights: np.ndarray
    number: int


@register_memoized_type
class Outer(NamedTuple):
    held: Held
    scale: float


def _held(dtype: type, layout: str = "C") -> Held:
    arrays = List()
    arrays.append(np.zeros(4, dtype))
    weights = np.zeros((3, 2), np.float32, order=layout)  # type: ignore[call-overload]
    return Held(arrays, weights, 7)


def _numba_own_type(value: tuple[Any, ...]) -> types.Type:
    """What numba's tuple typeof makes of a NamedTuple, built field by field."""
    return types.BaseTuple.from_types([numba.typeof(v) for v in value], type(value))


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    builds = [0]
    build = types.BaseTuple.from_types

    def counted(tys: Any, pyclass: Any = None) -> types.Type:
        builds[0] += 1
        return build(tys, pyclass)

    monkeypatch.setattr(types.BaseTuple, "from_types", staticmethod(counted))
    return builds


def test_a_registered_class_gets_the_type_numba_would_build() -> None:
    packed, _ = random_codes(8, 64, 4, 32)
    seg = segments_of([[packed]], int8=False)
    assert numba.typeof(seg) == _numba_own_type(seg)
    outer = Outer(_held(np.float32), 0.5)
    assert numba.typeof(outer) == types.BaseTuple.from_types([_numba_own_type(outer.held), types.float64], Outer)


def test_the_type_is_built_once_per_layout_of_the_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    first = numba.typeof(Outer(_held(np.int16), 1.0))
    builds = _count_builds(monkeypatch)
    again = numba.typeof(Outer(_held(np.int16), 2.0))  # other objects, the same layout
    assert again is first and builds[0] == 0
    # Any field typed otherwise is another key: a List of another item type, an F-ordered array.
    others = (Outer(_held(np.int8), 1.0), Outer(_held(np.int16, "F"), 1.0))
    built = [numba.typeof(other) for other in others]
    assert builds[0] == 4  # each new Outer and its new Held
    for other, ty in zip(others, built, strict=True):
        assert ty != first and ty == types.BaseTuple.from_types([_numba_own_type(other.held), types.float64], Outer)


def test_a_field_numba_cannot_fingerprint_is_typed_the_slow_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A set of fields with no key (an object numba types only in Python) still gets numba's own type."""

    @register_memoized_type
    class WithObject(NamedTuple):
        inner: Any

    class Loose(NamedTuple):  # not registered, and holding a List: numba has no fingerprint for it
        arrays: List

    loose = Loose(_held(np.float32).arrays)
    value = WithObject(loose)
    builds = _count_builds(monkeypatch)
    typed = [typeof_impl(value, _TypeofContext(Purpose.argument)) for _ in range(2)]
    assert builds[0] == 4  # nothing memoized: WithObject and Loose built on each call
    assert typed[0] == typed[1] == types.BaseTuple.from_types([_numba_own_type(loose)], WithObject)


def test_a_kernel_takes_the_memoized_type() -> None:
    @numba.njit
    def columns_and_first(seg: Segments) -> tuple[int, int]:
        return seg.columns, seg.data[0].shape[0]

    packed, _ = random_codes(8, 64, 4, 32)
    seg = segments_of([[packed]], int8=False)
    assert columns_and_first(seg) == (64, packed.codes.size)
    assert columns_and_first(segments_of([[packed]], int8=False)) == (64, packed.codes.size)
