"""Argument checks for the public API: a wrong value fails at once, in one line naming the
argument and what it takes, instead of deep inside numpy or a worker later."""

from __future__ import annotations

import operator
import os
from typing import Any

from .units import parse_size


def integer(name: str, value: Any, minimum: int | None = 0, maximum: int | None = None) -> int:
    """`value` as an int, if it is a whole number (an int, a numpy or 0-d torch integer; not
    a bool, a float or a str) within [minimum, maximum]; else TypeError or ValueError naming
    `name`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, not {value!r}") from None
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            bound = f"at least {minimum}"
        elif minimum is None:
            bound = f"at most {maximum}"
        else:
            bound = f"from {minimum} to {maximum}"
        raise ValueError(f"{name} must be {bound}, not {value}")
    return value


def optional(name: str, value: Any, minimum: int | None = 0, maximum: int | None = None) -> int | None:
    """`integer`, or None."""
    return None if value is None else integer(name, value, minimum, maximum)


def size(name: str, value: Any, minimum: int = 0) -> int:
    """Bytes in `value` (an int, or a str such as "256MB"), at least `minimum`; else an
    error naming `name`."""
    try:
        n = parse_size(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    if n < minimum:
        raise ValueError(f"{name} must be at least {minimum} bytes, not {value!r}")
    return n


def path(name: str, value: Any) -> str:
    """A path or URL given as a str or an os.PathLike (pathlib.Path), as a str."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a path or URL (a non-empty str or pathlib.Path), not {value!r}")
    return value
