"""`python -m shardkit`: the `shardkit` command, for environments without its script on PATH."""

from .cli import run

run(prog_name="shardkit")
