"""Reading a snapshot's JSON fields (:mod:`snapshot.manifest`): each of the type it must have, a
number one a file, a PID or a clock can hold; ValueError naming the field otherwise."""

from __future__ import annotations

import math
from dataclasses import MISSING, fields
from typing import Any, TypeVar

T = TypeVar("T")


def typed(d: Any, key: str, typ: type[T], where: str) -> T:
    """Field ``key`` of ``d``, a ``typ`` (ValueError naming it otherwise); a number one a file, a
    PID or a clock can hold: an integer in 64 bits, a float finite."""
    value = d.get(key) if isinstance(d, dict) else None
    if typ is float and isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**64:
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)) or not _held(value):
        raise ValueError(f"{where}.{key}")
    return value


def _held(value: object) -> bool:
    """Whether a number is one a field can hold (anything else is: its type is checked apart)."""
    if isinstance(value, int):
        return -(2**63) <= value < 2**64
    return math.isfinite(value) if isinstance(value, float) else True


def typed_list(d: Any, key: str, typ: type[T], where: str) -> list[T]:
    """Field ``key`` of ``d``, a list of ``typ`` (ValueError naming it otherwise)."""
    values = typed(d, key, list, where)
    if not all(isinstance(x, typ) and not (typ is int and isinstance(x, bool)) and _held(x) for x in values):
        raise ValueError(f"{where}.{key}[]")
    return values


def typed_rows(data: Any, key: str, cls: type[T]) -> list[T]:
    """The optional list ``key`` of ``data``, each item made a ``cls`` (a dataclass of int and
    str fields) from its fields of those names and types (a field with a default may be missing:
    one added since)."""
    types: dict[str, type[Any]] = {"int": int, "str": str}
    named = [(f.name, types[str(f.type)], f.default) for f in fields(cls)]  # type: ignore[arg-type]
    found = typed_list(data, key, dict, "manifest") if key in data else []
    return [cls(**{n: typed(x, n, t, f"{key}[]") for n, t, d in named if n in x or d is MISSING}) for x in found]
