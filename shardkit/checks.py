"""Argument checks for the public API: a wrong value fails at once, in one line naming the
argument and what it takes, instead of deep inside numpy or a worker later."""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Mapping
from typing import Any

from .units import parse_size

ON_ERROR = ("raise", "skip")  # what a bad sample or file does, in the reader and the packer alike


def integer(name: str, value: Any, minimum: int | None = 0, maximum: int | None = None) -> int:
    """`value` as an int, if it is a whole number (an int, a numpy or 0-d torch integer; not
    a bool, a float or a str) within [minimum, maximum]; else TypeError or ValueError naming
    `name`."""
    try:
        # a bool is no count; nor is an array or tensor of one element, or a 0-d bool tensor (operator.index takes them)
        if isinstance(value, bool) or getattr(value, "ndim", False) or "bool" in str(getattr(value, "dtype", "")):
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
    return int(value)


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


def flag(name: str, value: Any) -> bool:
    """True or False (a numpy bool too): a str such as "false" would read as true."""
    if not isinstance(value, bool) and not (
        type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    ):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return bool(value)


def function(name: str, value: Any) -> Any:
    """A callable, or None."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a function (or None), not {value!r}")
    return value


def mapping(name: str, value: Any) -> Any:
    """A dict of options, or None."""
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict (or None), not {value!r}")
    return value


def on_error(value: Any, stacklevel: int = 3) -> str:
    """``"raise"`` or ``"skip"``, for the reader and the packer alike. The packer's old
    ``"fail"`` is still taken, as ``"raise"``, with a DeprecationWarning pointing at the call
    (`stacklevel` 3: the caller of the function that checks)."""
    if isinstance(value, str) and value == "fail":
        warnings.warn('on_error="fail" is deprecated: use on_error="raise"', DeprecationWarning, stacklevel=stacklevel)
        return "raise"
    if not isinstance(value, str) or value not in ON_ERROR:
        raise ValueError(f"on_error must be 'raise' or 'skip', not {value!r}")
    return value
