"""What the commands share: the error-to-exit-code wrapper, the option types and callbacks,
and the options several commands take (-o, --on-error, --transform)."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from ..checks import ON_ERROR
from ..errors import ShardkitError, one_line, redact, shown_name
from ..tools import report
from ..units import parse_size


def errors_to_exit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ShardkitError (and a few OS errors) into a one-line message and exit code 1; Ctrl-C
    into 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ShardkitError as e:
            raise click.ClickException(report.message(e)) from None
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "torch":
                raise
            raise click.ClickException(
                "this command reads through PyTorch, which is not installed: pip install torch"
            ) from None
        except KeyboardInterrupt:  # Ctrl-C: the shell's code for SIGINT, not bad input's 1
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # `shardkit info URL | head`: the reader left early; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second one at exit's flush
            sys.exit(141)  # a shell's code for a command ended by SIGPIPE
        except OSError as e:  # FileExistsError, NotADirectoryError, ...: the path and the reason
            text = f"{shown_name(str(e.filename))}: {e.strerror or e}" if e.filename is not None else one_line(e)
            raise click.ClickException(redact(text)) from None

    return wrapper


def output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file to write at the end: its folder must exist before the work starts."""
    if value is not None and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
        raise click.BadParameter(f"{value}: no such folder to write it in")
    return value


def examples(*lines: str) -> str:
    """An epilog of example command lines, kept as written (click's \\b)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any] | None:
    """-o key=value pairs; values are JSON when they parse (numbers, true, {...}), else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint="-o")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out or None


def byte_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        size = parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if size < 1:
        raise click.BadParameter(f"must be at least 1 byte, not {value!r}")
    return size


class OnErrorChoice(click.Choice):  # type: ignore[type-arg]  # generic from click 8.2 on, not in 8.1
    """--on-error raise|skip, the words of on_error= in Python; pack's old "fail" is still taken,
    as raise, with a warning on stderr."""

    def __init__(self) -> None:
        super().__init__(ON_ERROR)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "fail":
            click.echo("Warning: --on-error fail is deprecated: use --on-error raise", err=True)
            return "raise"
        return super().convert(value, param, ctx)


storage_option = click.option(
    "-o",
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec storage option, repeatable (e.g. -o endpoint_url=http://127.0.0.1:9000); shardkit's own: "
    "-o timeout=SECONDS (silence before a request is retried, default 20), -o attempts=N.",
)


def _transform(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """Import --transform now, so a wrong name is a usage error before anything starts."""
    if value is None:
        return None
    from ..bench.transforms import Transform

    try:
        return Transform(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


read_error_option = click.option(
    "--on-error",
    type=OnErrorChoice(),
    default="raise",
    show_default=True,
    help="On a bad sample (undecodable image, truncated shard): stop with an error naming it, "
    "or leave it out and count it.",
)

transform_option = click.option(
    "--transform",
    metavar="MODULE:FUNCTION",
    callback=_transform,
    help="Function applied to each decoded sample dict, from an importable module or a file (path/to/file.py:fn).",
)
