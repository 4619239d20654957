"""`shardkit` command line: thin click wrappers over the Python API, a module per family of
commands (pack; info, verify, index, preview; bench), each parsing, calling and reporting.

Exit codes: 0 success, 1 a shardkit error (bad input, corrupt shard; the message names it),
2 a usage error (click's convention).
"""

from __future__ import annotations

from typing import Any

import click

from ..interrupts import exit_on_second_ctrl_c
from .bench import bench
from .pack import pack
from .read import index_cmd, info, preview, verify


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(None, "-V", "--version", package_name="shardkit")
def main() -> None:
    """Pack image folders into WebDataset-compatible shards and inspect them."""


for command in (pack, info, verify, index_cmd, bench, preview):
    main.add_command(command)


def run(*args: Any, **kwargs: Any) -> Any:
    """The `shardkit` command (its script and `python -m shardkit`): `main` with a second
    Ctrl-C that exits at once. `main` itself, called in a user's process (a notebook, a test's
    CliRunner), leaves that process's Ctrl-C alone."""
    exit_on_second_ctrl_c()
    return main(*args, **kwargs)
