"""Values checked against a dataclass's own definition: the keys against its fields, each value against the
field's annotation (bool, int, float, str, None, Literal, list, dict, nested dataclasses) and its ``bounds``
metadata (ge, gt, le, lt). The config's values (from YAML and flags), the trainer state with its epoch records,
and a run's results all go through ``check_value``, so a field added to one of them is checked without another
line."""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

T = TypeVar("T")
Invalid = Callable[[str], Exception]  # a problem -> the exception to raise, which says where the data came from

_BOUNDS = {
    "ge": (">=", lambda v, b: v >= b),
    "gt": (">", lambda v, b: v > b),
    "le": ("<=", lambda v, b: v <= b),
    "lt": ("<", lambda v, b: v < b),
}


def bounds(**limits: float) -> dict[str, dict[str, float]]:
    """Field metadata for numeric bounds: ``field(metadata=bounds(ge=0))``."""
    return {"bounds": limits}


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 2, 60, 60
_SHORT_REPR.maxtuple = _SHORT_REPR.maxlist = _SHORT_REPR.maxdict = _SHORT_REPR.maxset = 4


def quote(value: object, limit: int = 80) -> str:
    """A short ``repr(value)`` for error messages that must stay one short line: its work is bounded too (a YAML
    alias can make a small file a value with billions of elements), since ``reprlib`` stops at a few elements a
    level and a few levels."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def from_json(cls: type[T], data: object, invalid: Invalid, where: str = "") -> T:
    """``cls(**data)`` once every key and value of ``data`` fits ``cls``'s fields; a field with a default may be
    missing (a file written before it existed). ``where`` prefixes the names in messages (``history[3].``)."""
    if not isinstance(data, dict):
        raise invalid(f"{where.rstrip('.') or 'the file'} must be a JSON object, not {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    required = {
        n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }  # noqa: E501
    if unknown := sorted(map(str, set(data) - set(fields))):
        raise invalid(f"unexpected keys in {where.rstrip('.') or 'the file'}: {', '.join(unknown)[:200]}")
    if missing := sorted(required - set(data)):
        raise invalid(f"missing keys in {where.rstrip('.') or 'the file'}: {', '.join(missing)}")
    values = {
        name: check_value(hints[name], value, f"{where}{name}", invalid, fields[name].metadata.get("bounds", {}))
        for name, value in data.items()
    }
    return cls(**values)


def check_value(annotation: Any, value: object, name: str, invalid: Invalid, limits: dict[str, float]) -> Any:
    """``value`` as ``annotation`` says (an int where a float is due becomes a float), or ``invalid`` naming the
    field and what it accepts: the type, the choices of a Literal, a finite number, a string that is not blank,
    and the bounds ``limits``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        if annotation in (int, float) and isinstance(value, str) and value.lower() == "none":
            raise invalid(f"'{name}' must be {annotation.__name__} or null, not {quote(value)}: YAML's none is null")
        return check_value(annotation, value, name, invalid, limits)
    if annotation is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise invalid(f"'{name}' must be one of {', '.join(map(str, args))}, not {quote(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise invalid(f"'{name}' must be a list, not {type(value).__name__} ({quote(value)})")
        return [check_value(args[0], item, f"{name}[{i}]", invalid, limits) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise invalid(f"'{name}' must be a mapping, not {type(value).__name__} ({quote(value)})")
        return value
    if dataclasses.is_dataclass(annotation):
        return from_json(annotation, value, invalid, f"{name}.")
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[annotation]
    if type(value) not in kinds:
        hint = ": true or false" if annotation is bool else ""
        raise invalid(f"'{name}' must be {annotation.__name__}{hint}, not {type(value).__name__} ({quote(value)})")
    if annotation is float:
        value = float(value)
        if not math.isfinite(value):
            raise invalid(f"'{name}' must be a finite number, not {quote(value)}")
    if annotation is str and not value.strip():
        raise invalid(f"'{name}' must not be an empty string")
    for bound, limit in limits.items():
        symbol, holds = _BOUNDS[bound]
        if not holds(value, limit):
            raise invalid(f"'{name}' must be {symbol} {limit}, got {quote(value)}")
    return value
