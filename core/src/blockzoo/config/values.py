"""Structuring plain values (numbers, strings, booleans, literals): strict about their types, with messages that
say what was expected and what was given."""

from __future__ import annotations

import contextlib
import contextvars
import math
import typing
from typing import Any, Literal


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return f"{value!r} ({type(value).__name__})"


# Integers are 64-bit, what torch indexes with: a larger value cannot be a size, a count or a seed.
INT_MAX = 2**63 - 1
INT_MIN = -(2**63)
# A float is taken as an int only when it is a whole number that a float holds exactly (4.0, not 2.5 or 1e30).
_EXACT_FLOAT_INT = 2**53

# Set while the floats of a field declared `infinite=True` are structured.
_allow_infinite: contextvars.ContextVar[bool] = contextvars.ContextVar("allow_infinite", default=False)


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 30 else f"a {len(text.lstrip('-'))}-digit integer"


def _structure_int(value: Any, _: type) -> int:
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_FLOAT_INT:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {_describe(value)}")
    if not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"{_short(value)} does not fit in 64 bits: integers must be between {INT_MIN} and {INT_MAX}")
    return value


def _structure_float(value: Any, _: type) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"{_short(value)} is too large for a number") from None
    elif isinstance(value, str):
        # YAML 1.1 reads `1e-5` (no dot) as a string; accept numeric strings for float fields.
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise ValueError(f"expected a number, got {_describe(value)}")
    if math.isnan(number):
        raise ValueError(f"expected a number, got {value!r} (not a number)")
    if math.isinf(number) and not _allow_infinite.get():
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _structure_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_describe(value)}")
    return value


def _structure_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_describe(value)}")
    return value


def _key_problem(key: Any) -> str:
    """Why a mapping key that is not a string is refused (YAML 1.1 reads unquoted `on`, `no`, `1` as bool or int)."""
    message = f"the key {_describe(key)} is not a string"
    if key is None:
        return f"{message}: YAML reads an unquoted null or ~ as null; quote the key"
    if isinstance(key, bool):
        spelled, example = ("on/yes/true", "on") if key else ("off/no/false", "off")
        return f"{message}: YAML reads an unquoted {spelled} as {str(key).lower()}; quote the key (e.g. '{example}')"
    return f"{message}; quote it in YAML ('{key}')"


def _origin_is(*origins: type) -> Any:
    return lambda annotation: typing.get_origin(annotation) in origins or annotation in origins


def _structure_literal(value: Any, literal: Any) -> Any:
    choices = typing.get_args(literal)
    if not any(value == choice and type(value) is type(choice) for choice in choices):
        raise ValueError(f"expected one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value


def _is_literal(annotation: Any) -> bool:
    return typing.get_origin(annotation) is Literal
